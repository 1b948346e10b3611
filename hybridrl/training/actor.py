"""The policy on megatron: log-probs of response tokens (actor and reference) and the PPO update.

Batch columns (per rank: this DP rank's rows, as the controller dispatches them):
  in:  `input_ids`, `attention_mask`, `position_ids` `[B, T]`; `responses`, `response_mask` `[B, R]`
       (see `sequences`); `meta["temperature"]` (default 1.0) divides the logits in every log-prob
       this module computes — old, reference, the update's own and the probe's — as in sampling.
  `compute_log_prob` out: `<output_key>` `[B, R]` (`old_log_probs` for the actor, `ref_log_probs`
       for the reference), optionally `entropys` `[B, R]`; 0 where `response_mask` is 0.
  `update_policy` in: also `old_log_probs`, `advantages` `[B, R]`, and `ref_log_probs` with
       `use_kl_loss`.
Results are returned on the output ranks (last pipeline stage, TP rank 0); other ranks return None.

The old policy is the tempered softmax over the whole vocabulary. vLLM samples after top-k/top-p and
reports log-probs of that truncated, renormalized distribution (`rollout_log_probs`), so with those
filters on the rollout's log-probs sit above the trainer's by log(1 / kept mass) and
`rollout/log_prob_abs_diff_max` measures the truncation, not a numerics error. PPO's ratio is taken
against the trainer's old log-probs, never against the rollout's.

Rollout-mismatch correction (`algorithm.rollout_correction`, off by default): the rollout's log-probs
are the behaviour policy and the old policy the target, rho = exp(old - rollout) per token;
`hybridrl.algorithms.rollout_correction` turns it into a detached factor on each token's
policy-gradient loss (TIS weight min(rho, C), token or sequence level; MIS mask, token, sequence or
geometric level). Without the old-log-prob pass the target is the update's own forward, detached:
that pass is skipped only when it would give the same numbers (one optimizer step on data the
current weights generated). The factor touches the PG term only: the entropy bonus and the KL loss
regularize the current policy at every sampled state and keep every token. Masked tokens still count
in `global_loss_normalizers` (the loss keeps its scale and its split invariance). With
`match_truncation` the target is the old policy under the rollout's top-k/top-p
(`hybridrl.algorithms.truncation`): `compute_log_prob` (the actor's, not the reference's) also writes
`old_log_probs_truncated` and `old_log_probs_outside`, or, without the pass, the update computes it from
its own forward (`truncation_outside_fraction` then comes from the update); PPO's ratio keeps the
whole-vocabulary old log-probs.
`rollout_correction/*` metrics: `is_weight_mean` (token-weighted mean over the update's micro-batches,
averaged over optimizer steps), `is_weight_max` and `log_ratio_abs_max` (max over every step),
`masked_token_fraction`, `masked_seq_fraction` (per mini-batch, averaged over steps).

Log-probs never gather the vocabulary, and the vocabulary head sees only the columns that predict
response tokens (the last stage's hidden states are cut to the N real ones before the output layer,
see `MegatronBackend.forward_only`'s `response_tokens_only`): the logits are `[N, V/tp]`, padded vocab
ids are masked (megatron pads the vocab with logit-0 rows), and `vocab_parallel_log_prob` (alone or
`_and_entropy`, one pass for both) reduces over the TP group.

Loss normalization. Per mini-batch, `global_loss_normalizers` counts tokens and sequences over
every micro-batch on every DP rank; each micro-batch's losses use those totals, so their sum over
micro-batches and DP ranks is the mini-batch loss exactly, however the rows were cut. Megatron's
schedule divides a returned loss by the number of micro-batches and DDP averages gradients over
DP, so the loss handed to megatron is scaled by `num_microbatches * dp_size` (checked against a
single-rank run in tests/training/test_ranks.py, and gradient by gradient against the objective
recomputed from transformers in tests/training/test_actor_reference.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial

import torch

from hybridrl.algorithms.aggregation import LossNormalizers, aggregate_loss
from hybridrl.algorithms.distillation import TEACHER_FULL_KEY, TEACHER_TOP_K_KEYS
from hybridrl.algorithms.kl import kl_penalty
from hybridrl.algorithms.losses import ppo_policy_loss
from hybridrl.algorithms.rollout_correction import RolloutCorrection, correction_metrics, rollout_correction_weights
from hybridrl.algorithms.truncation import Truncation, truncated_log_prob
from hybridrl.algorithms.vocab_parallel import (
    vocab_parallel_log_prob,
    vocab_parallel_log_prob_and_entropy,
    vocab_parallel_log_probs_at,
    vocab_parallel_log_softmax,
    vocab_parallel_reverse_kl,
    vocab_parallel_top_k,
)
from hybridrl.config.plan import Plan
from hybridrl.data.batch import Batch
from hybridrl.models.bridge import mask_vocab_padding
from hybridrl.names import Role
from hybridrl.parallel.device import collective_device
from hybridrl.training.backend import MegatronBackend
from hybridrl.training.metrics import average_steps
from hybridrl.training.micro_batching import restore_order
from hybridrl.training.mini_batch import train_mini_batch
from hybridrl.training.moe_metrics import MoERouterMetrics
from hybridrl.training.router_replay import ReplayMismatch
from hybridrl.training.sequences import ModelInputs

# ids travel among a pass's float columns: exact in float32 up to 2**24 (every vocabulary so far is far below)
EXACT_FLOAT32_IDS = 1 << 24


@dataclass(frozen=True)
class PolicyLossSettings:
    """The PPO loss knobs, resolved from the Plan once."""

    clip_low: float
    clip_high: float
    dual_clip: float | None
    agg: str
    entropy_coeff: float
    use_kl_loss: bool
    kl_coef: float
    kl_type: str
    norm_length: int  # the constant T of seq-mean-token-sum-norm: the configured response length
    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)
    # match_truncation: the rollout's top-k/top-p, under which the correction's target is computed
    truncation: Truncation | None = None
    # on-policy distillation's loss term: top_k_forward_kl (the teacher's top-k tokens per position; 0 = off) or
    # full_reverse_kl (the teacher's whole distribution), and the term's weight
    distillation_top_k: int = 0
    distillation_full_vocab: bool = False
    distillation_coef: float = 0.0

    @property
    def distillation_term(self) -> str | None:
        """The distillation loss term in the update (`algorithm.distillation.loss`), None without one."""
        if self.distillation_top_k:
            return "top_k_forward_kl"
        return "full_reverse_kl" if self.distillation_full_vocab else None

    @classmethod
    def from_plan(cls, plan: Plan) -> PolicyLossSettings:
        actor = plan.config.actor_rollout_ref.actor
        rc = plan.config.algorithm.rollout_correction
        correction = RolloutCorrection(rc.is_level, rc.is_cap, rc.mask_level, rc.mask_low, rc.mask_high)
        truncation = None
        if rc.match_truncation and correction.enabled:
            rollout = plan.config.actor_rollout_ref.rollout
            truncation = Truncation(rollout.top_k if rollout.top_k > 0 else None, rollout.top_p,
                                    plan.device_policy.vllm_top_k_keeps_ties)
        return cls(plan.resolved.clip_ratio_low, plan.resolved.clip_ratio_high, actor.clip_ratio_c,
                   actor.loss_agg_mode, actor.entropy_coeff, actor.use_kl_loss, actor.kl_loss_coef,
                   actor.kl_loss_type, plan.resolved.response_length, correction, truncation,
                   plan.resolved.distillation_top_k, plan.resolved.distillation_full_vocab,
                   float(plan.config.algorithm.distillation.kl_coef))


@dataclass(frozen=True)
class PolicyUpdateMetrics:
    """Means over the optimizer steps of one `update_policy` call (per step in `per_step`)."""

    pg_loss: float
    clipfrac: float
    clipfrac_lower: float
    approx_kl: float
    entropy: float
    kl_loss: float
    grad_norm: float
    lr: float
    optimizer_steps: int
    # on-policy distillation's loss term (`distillation_term`: top_k_forward_kl, KL(teacher's top-k || student), or
    # full_reverse_kl, KL(student || teacher) over the vocabulary), aggregated as the policy loss
    distillation_loss: float | None = None
    distillation_term: str | None = None
    per_step: tuple[dict[str, float], ...] = field(default=())
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient
    # max and token mean of |megatron - rollout| log-prob over the batch, when the update stood in for
    # the old-log-prob pass (on-policy: one optimizer step); None otherwise
    rollout_log_prob_abs_diff_max: float | None = None
    rollout_log_prob_abs_diff_mean: float | None = None
    # padding columns / computed columns of the update's micro-batches, over the DP group
    padding_ratio: float = 0.0
    # the share of the update's row tokens not computed because rows shared their prompt (shared_prefix)
    shared_prefix_ratio: float = 0.0
    # MoE models: `actor/moe_aux_loss`, `actor/moe_z_loss`, `actor/moe_expert_imbalance`,
    # `actor/moe_dropped_token_fraction` (`training/moe_metrics.py`)
    moe: dict[str, float] = field(default_factory=dict)
    # algorithm.rollout_correction on: `rollout_correction/<name>` (see the module docstring)
    rollout_correction: dict[str, float] = field(default_factory=dict)

    def as_dict(self, prefix: str = "actor/") -> dict[str, float]:
        names = ("pg_loss", "clipfrac", "clipfrac_lower", "approx_kl", "entropy", "kl_loss", "grad_norm", "lr",
                 "skipped_steps")
        out = {prefix + n: getattr(self, n) for n in names}
        out["perf/padding_ratio"] = self.padding_ratio
        out["perf/shared_prefix_ratio"] = self.shared_prefix_ratio
        if self.rollout_log_prob_abs_diff_max is not None:
            out["rollout/log_prob_abs_diff_max"] = self.rollout_log_prob_abs_diff_max
        if self.rollout_log_prob_abs_diff_mean is not None:
            out["rollout/log_prob_abs_diff_mean"] = self.rollout_log_prob_abs_diff_mean
        if self.distillation_loss is not None:
            out[f"distillation/{self.distillation_term}"] = self.distillation_loss
        out.update(self.moe)
        out.update(self.rollout_correction)
        return out


def sampling_temperature(batch: Batch) -> float:
    """The temperature the batch's responses were sampled at (`meta["temperature"]`, default 1).

    Greedy decoding (0) scores the unscaled logits, as vLLM reports log-probs for greedy requests.
    """
    temperature = float(batch.meta.get("temperature", 1.0))
    if temperature < 0:
        raise ValueError(f"batch meta temperature={temperature} must be >= 0")
    return temperature if temperature > 0 else 1.0


def require_rollout_log_probs(batch: Batch, correction: RolloutCorrection) -> bool:
    """Whether the update needs the rollout's log-probs (the correction is on); raises when they are missing."""
    if not correction.enabled:
        return False
    if "rollout_log_probs" not in batch.tensors:
        raise ValueError(
            f"algorithm.rollout_correction (is_level={correction.is_level}, mask_level={correction.mask_level}) "
            "needs the rollout's log-probs (`rollout_log_probs`, the behaviour policy) in the batch; this batch "
            "has none: generate it with the rollout engine (it always returns them), or set "
            "algorithm.rollout_correction.is_level and mask_level to none")
    return True


def response_logits(backend: MegatronBackend, micro: ModelInputs, logits: torch.Tensor,
                    temperature: float, vocab_size: int = 0) -> torch.Tensor:
    """The vocab shard `[N, V/tp]` (float32) predicting each of the N real response tokens, padded ids masked.

    `logits` `[1, N, V/tp]` are the model's output of a `response_tokens_only` run. With `vocab_size` below the
    model's own (a teacher of more rows than its student's), the ids from `vocab_size` on are masked too.
    """
    ctx = backend.ctx
    picked = logits.squeeze(0).float()
    if temperature != 1.0:
        picked = picked / temperature
    real = min(backend.vocab_size, vocab_size) if vocab_size else backend.vocab_size
    return mask_vocab_padding(picked, real, ctx.tp_rank, ctx.tp)


class MegatronActor:
    """Log-probs and (for a trainable backend) PPO updates of one policy role on this rank."""

    def __init__(self, backend: MegatronBackend, plan: Plan, *, log_prob_pass: str = "old_log_prob",
                 output_key: str = "old_log_probs") -> None:
        self.backend = backend
        self.plan = plan
        self.output_key = output_key
        self.forward_plan = plan.forward(log_prob_pass)
        self.loss = PolicyLossSettings.from_plan(plan)
        actor = plan.config.actor_rollout_ref.actor
        self.dynamic = actor.use_dynamic_bsz
        self.max_tokens = actor.ppo_max_token_len_per_gpu
        self.shuffle = actor.shuffle
        self.seed = plan.config.trainer.seed
        shape = backend.source.shape
        self.moe_metrics = (MoERouterMetrics(backend.chunks, shape.num_layers, shape.num_experts, shape.moe_top_k)
                            if shape.is_moe else None)

    # ---------------------------------------------------------------------------- log-probs
    def compute_log_prob(self, batch: Batch, with_entropy: bool = False, *,
                         free_routing: bool = False, top_k: int = 0, full_vocab: int = 0,
                         vocab_size: int = 0) -> Batch | None:
        """Log-probs of the batch's responses (module docstring). With routing replay the forward
        routes as the rollout did, unless `free_routing` (the weight sync's probe: a fixed sequence
        no rollout generated, scored with the routers' own choice on both sides, and with every token
        kept: no expert capacity, as in vLLM). A teacher's pass also writes its top-k tokens at each response
        position (`top_k`, TEACHER_TOP_K_KEYS) or its log-probs of the first `full_vocab` ids (the student's
        vocabulary, TEACHER_FULL_KEY). `vocab_size` (a teacher's pass: the student's vocabulary) scores over the
        first `vocab_size` ids only, the distribution renormalised over them: a teacher of more rows than the
        student (a padded vocabulary of one tokenizer) is read over the ids the student can write."""
        backend, ctx = self.backend, self.backend.ctx
        tensors = batch.tensors
        temperature = sampling_temperature(batch)
        forward = self.forward_plan  # this pass's own batching (verl's log_prob_use_dynamic_bsz / _max_token_len)
        partition = backend.partition(tensors, forward.micro_batch_size, dynamic=forward.dynamic_batching,
                                      max_tokens=forward.max_tokens_per_micro_batch)
        backend.tokens_seen.reset()
        backend.replay_mismatch = ReplayMismatch()
        micros = backend.micro_batches(tensors, partition, free_routing=free_routing)
        padding_ratio, shared_ratio = backend.tokens_seen.ratios(ctx.dp_group)  # every rank: a DP collective

        # the actor's old policy under the rollout's truncation too (the correction's target); never the reference's
        truncation = self.loss.truncation if self.output_key == "old_log_probs" else None
        if top_k and backend.vocab_size >= EXACT_FLOAT32_IDS:
            raise ValueError(f"top-k ids of a {backend.vocab_size}-token vocabulary do not travel exactly as float32")

        def collect(micro: ModelInputs, logits: torch.Tensor) -> torch.Tensor:
            shard = response_logits(backend, micro, logits, temperature, vocab_size)
            labels = micro.responses[micro.response_token_positions()]
            if not with_entropy:
                columns = [vocab_parallel_log_prob(shard, labels, ctx.tp_group)]
            else:
                columns = list(vocab_parallel_log_prob_and_entropy(shard, labels, ctx.tp_group))
            if truncation is not None:
                target = truncated_log_prob(shard, labels, truncation, ctx.tp_group)
                columns += [target.log_prob, target.outside.to(target.log_prob.dtype)]
            stacked = torch.stack(columns, dim=-1)
            if top_k:  # the distribution at each position: k log-probs, then their k ids
                top_log_probs, top_ids = vocab_parallel_top_k(shard, top_k, ctx.tp_group)
                stacked = torch.cat([stacked, top_log_probs.to(stacked.dtype), top_ids.to(stacked.dtype)], dim=-1)
            if full_vocab:  # the whole distribution at each position, gathered over TP
                table = vocab_parallel_log_softmax(shard, ctx.tp_group)[..., :full_vocab]
                stacked = torch.cat([stacked, table.to(stacked.dtype)], dim=-1)
            return micro.scatter_response_tokens(stacked)

        # free routing is also dropless: the probe proves the weights against vLLM, which has no capacity
        with backend.without_capacity() if free_routing else contextlib.nullcontext():
            outputs = backend.forward_only(micros, collect, response_tokens_only=True)
        mismatch = None if free_routing else self._replay_mismatch()  # every rank: a world collective
        if not backend.is_output_rank:
            return None
        stacked = restore_order(outputs, partition).cpu()  # results go back to the controller
        mask = tensors["response_mask"].to(stacked.dtype).unsqueeze(-1)
        stacked = stacked * mask
        out = {self.output_key: stacked[..., 0].contiguous()}
        if with_entropy:
            out["entropys"] = stacked[..., 1].contiguous()
        if full_vocab:
            out[TEACHER_FULL_KEY] = stacked[..., -full_vocab:].contiguous()
            stacked = stacked[..., :-full_vocab]
        if top_k:
            log_probs_key, ids_key = TEACHER_TOP_K_KEYS
            out[log_probs_key] = stacked[..., -2 * top_k:-top_k].contiguous()
            out[ids_key] = stacked[..., -top_k:].round().long()
            stacked = stacked[..., :-2 * top_k]
        if truncation is not None:
            out["old_log_probs_truncated"] = stacked[..., -2].contiguous()
            out["old_log_probs_outside"] = stacked[..., -1] != 0  # masked positions scattered as 0: False
        # padding columns / computed columns of this pass's micro-batches over the DP group
        meta = {"padding_ratio": padding_ratio, "shared_prefix_ratio": shared_ratio}
        if mismatch is not None:
            meta["router_replay_mismatch"] = mismatch
        return Batch(out, meta=meta)

    # -------------------------------------------------------------------------------- update
    def update_policy(self, batch: Batch) -> PolicyUpdateMetrics | None:
        backend = self.backend
        update = self.plan.update(Role.ACTOR)
        per_mini = update.sequences_per_rank_per_mini_batch
        rows = len(batch)
        if rows % per_mini:
            raise ValueError(f"{rows} rows on this rank do not split into mini-batches of {per_mini} "
                             f"(ppo_mini_batch_size x rollout.n / dp)")
        if "old_log_probs" not in batch.tensors and self.plan.resolved.old_log_prob_pass:
            raise ValueError("update_policy needs `old_log_probs`: this plan runs more than one optimizer step per "
                             "batch (or KL in the reward), so the update's own forward is not the old policy")
        # Without the old-log-prob pass, the first step's forward also measures the rollout's log-prob
        # gap (the pass measures it otherwise, over every row).
        gap_key = "old_log_probs" if "old_log_probs" in batch.tensors else "rollout_log_probs"
        optional = (gap_key,) + (("ref_log_probs",) if self.loss.use_kl_loss else ())
        if require_rollout_log_probs(batch, self.loss.rollout_correction) and gap_key != "rollout_log_probs":
            optional += ("rollout_log_probs",)
        if self.loss.truncation is not None and "old_log_probs" in batch.tensors:
            if "old_log_probs_truncated" not in batch.tensors:
                raise ValueError("algorithm.rollout_correction.match_truncation needs `old_log_probs_truncated` "
                                 "next to `old_log_probs`: the actor's compute_log_prob writes both")
            optional += ("old_log_probs_truncated",)
        if self.loss.distillation_top_k:
            missing = [k for k in TEACHER_TOP_K_KEYS if k not in batch.tensors]
            if missing:
                raise ValueError(f"algorithm.distillation.loss=top_k_forward_kl needs the teacher's {missing}: the "
                                 "TeacherWorker's pass writes them")
            optional += TEACHER_TOP_K_KEYS
        if self.loss.distillation_full_vocab:
            if TEACHER_FULL_KEY not in batch.tensors:
                raise ValueError(f"algorithm.distillation.loss=full_reverse_kl needs the teacher's {TEACHER_FULL_KEY}: "
                                 "the TeacherWorker's pass writes it")
            optional += (TEACHER_FULL_KEY,)
        extra_keys = ("advantages",) + tuple(k for k in optional if k in batch.tensors)
        # The update scores the responses under the distribution they were sampled from, as the
        # old-log-prob pass, the reference and the rollout do: at T != 1 an untempered update would
        # make the ratio differ from 1 on the policy's own samples.
        loss = partial(self._policy_loss, temperature=sampling_temperature(batch))
        steps: list[dict[str, float]] = []
        skipped = 0
        backend.tokens_seen.reset()
        backend.replay_mismatch = ReplayMismatch()
        if self.moe_metrics is not None:
            self.moe_metrics.reset()
        for epoch in range(update.ppo_epochs):
            order = self._row_order(batch, epoch)
            for start in range(0, rows, per_mini):
                step, applied = train_mini_batch(
                    backend, batch, order[start:start + per_mini], update.micro_batch_size, loss,
                    extra_keys=extra_keys, dynamic=self.dynamic, max_tokens=self.max_tokens,
                    response_tokens_only=True)
                skipped += not applied
                steps.append(step)
        backend.finish_param_gather()
        padding_ratio, shared_ratio = backend.tokens_seen.ratios(backend.ctx.dp_group)
        moe = ({} if self.moe_metrics is None else
               self.moe_metrics.collect(backend.ctx, collective_device(), bool(backend.config.sequence_parallel)))
        mismatch = self._replay_mismatch()
        if mismatch is not None:
            moe["actor/router_replay_mismatch"] = mismatch
        if not backend.is_output_rank:
            return None
        mean = average_steps(steps)
        # maxima over every optimizer step; fractions and means averaged over them
        corrections = {key: (max(s[key] for s in steps if key in s) if key.endswith("_max") else value)
                       for key, value in mean.items() if key.startswith("rollout_correction/")}
        return PolicyUpdateMetrics(
            pg_loss=mean["pg_loss"], clipfrac=mean["clipfrac"], clipfrac_lower=mean["clipfrac_lower"],
            approx_kl=mean["approx_kl"], entropy=mean["entropy"], kl_loss=mean.get("kl_loss", 0.0),
            grad_norm=mean["grad_norm"], lr=mean["lr"], optimizer_steps=len(steps),
            distillation_loss=mean.get("distillation_loss"), distillation_term=self.loss.distillation_term,
            per_step=tuple(steps),
            skipped_steps=skipped,
            rollout_log_prob_abs_diff_max=steps[0].get("rollout_log_prob_abs_diff_max"),
            rollout_log_prob_abs_diff_mean=steps[0].get("rollout_log_prob_abs_diff_mean"),
            padding_ratio=padding_ratio, shared_prefix_ratio=shared_ratio, moe=moe, rollout_correction=corrections,
        )

    def _replay_mismatch(self) -> float | None:
        """With routing replay: the fraction of (token, MoE layer) routings vLLM made that megatron's
        own router would have made differently, over this pass's forwards on every rank (None without
        replay). A world all-reduce, so every rank calls it: PP stages count their own layers, DP/EP
        ranks their own tokens, and TP peers the same ones (a common factor of both counts)."""
        if not self.backend.spec.router_replay:
            return None
        counts = self.backend.replay_mismatch
        packed = torch.tensor([counts.differing, counts.tokens], dtype=torch.float64, device=collective_device())
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(packed)
        differing, tokens = packed.tolist()
        return differing / tokens if tokens else 0.0

    def _row_order(self, batch: Batch, epoch: int) -> list[int]:
        rows = len(batch)
        if not self.shuffle or epoch == 0:
            return list(range(rows))
        # Same permutation on the TP/PP peers of this DP rank: a private generator from the seed.
        gen = torch.Generator().manual_seed(self.seed * 1000003 + epoch)
        if not self.backend.spec.shared_prefix:
            return torch.randperm(rows, generator=gen).tolist()
        # rows sharing a prompt stay next to each other (their micro-batch computes it once): whole
        # prompt groups are shuffled
        groups = self.backend.prompt_groups(batch.tensors)
        return [row for g in torch.randperm(len(groups), generator=gen).tolist() for row in groups[g]]

    def _policy_loss(self, micro: ModelInputs, logits: torch.Tensor, *, normalizers: LossNormalizers,
                     scale: float, temperature: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ctx, cfg = self.backend.ctx, self.loss
        shard = response_logits(self.backend, micro, logits, temperature)
        # one pass over the vocabulary for both; the entropy is differentiated only when it is in the loss
        per_token = vocab_parallel_log_prob_and_entropy(shard, micro.responses[micro.response_token_positions()],
                                                        ctx.tp_group, entropy_grad=cfg.entropy_coeff != 0.0)
        log_prob, entropy = (micro.scatter_response_tokens(t) for t in per_token)  # [b, R], 0 on padding
        mask = micro.response_mask.to(log_prob.dtype)
        norm = dict(normalizers.as_kwargs(), norm_length=cfg.norm_length)
        # Without an old-log-prob pass the update is on-policy (one optimizer step on fresh data): the
        # old policy is this very forward, detached, and the ratio is exactly 1.
        old_log_prob = micro.extras.get("old_log_probs")
        old_log_prob = log_prob.detach() if old_log_prob is None else old_log_prob.to(log_prob.dtype)
        token_weight, correction = None, {}
        if cfg.rollout_correction.enabled:  # update_policy refused a batch without the rollout log-probs
            # The correction's target: the old policy, under vLLM's truncation with match_truncation
            # (PPO's ratio below keeps the whole vocabulary: it is the policy being optimised).
            target = old_log_prob
            if cfg.truncation is not None:
                target = micro.extras.get("old_log_probs_truncated")
                if target is None:  # no old-log-prob pass: this forward is the old policy
                    labels = micro.responses[micro.response_token_positions()]
                    truncated = truncated_log_prob(shard, labels, cfg.truncation, ctx.tp_group)
                    target, outside = (micro.scatter_response_tokens(t) for t in
                                       (truncated.log_prob, truncated.outside.to(log_prob.dtype)))
                    correction["total/rollout_correction/truncation_outside_fraction"] = (
                        (outside * mask).sum() / normalizers.tokens.clamp(min=1))
                target = target.to(log_prob.dtype)
            result = rollout_correction_weights(target, micro.extras["rollout_log_probs"], mask,
                                                cfg.rollout_correction)
            token_weight = result.token_weight
            correction.update(correction_metrics(result, mask, cfg.rollout_correction, normalizers.tokens,
                                                 normalizers.seqs))
        pg_loss, pg_metrics = ppo_policy_loss(
            log_prob, old_log_prob, micro.extras["advantages"].to(log_prob.dtype),
            mask, cfg.clip_low, cfg.clip_high, cfg.dual_clip, cfg.agg, **norm, token_weight=token_weight,
        )
        loss = pg_loss
        if cfg.entropy_coeff != 0.0:
            loss = loss - cfg.entropy_coeff * aggregate_loss(entropy, mask, cfg.agg, **norm)
        tokens = mask.sum()
        metrics = {
            "weight": tokens.detach(),
            "total/pg_loss": pg_loss.detach().clone(),
            "mean/clipfrac": pg_metrics["clipfrac"],
            "mean/clipfrac_lower": pg_metrics["clipfrac_lower"],
            "mean/approx_kl": pg_metrics["approx_kl"],
            "mean/entropy": (entropy.detach() * mask).sum() / tokens.clamp(min=1),
            **correction,
        }
        # the rollout engine's numerics vs megatron's, per step, when no old-log-prob pass measured it
        if "rollout_log_probs" in micro.extras and "old_log_probs" not in micro.extras:
            gap = (log_prob.detach() - micro.extras["rollout_log_probs"].to(log_prob.dtype)).abs() * mask
            metrics["max/rollout_log_prob_abs_diff_max"] = gap.max() if gap.numel() else torch.zeros(())
            metrics["mean/rollout_log_prob_abs_diff_mean"] = gap.sum() / tokens.clamp(min=1)
        if cfg.use_kl_loss:
            kl = kl_penalty(log_prob, micro.extras["ref_log_probs"].to(log_prob.dtype), cfg.kl_type)
            kl_loss = aggregate_loss(kl, mask, cfg.agg, **norm)
            loss = loss + cfg.kl_coef * kl_loss
            metrics["total/kl_loss"] = kl_loss.detach().clone()
        if cfg.distillation_term is not None:
            distill = (self._top_k_forward_kl(micro, shard) if cfg.distillation_top_k else
                       self._full_reverse_kl(micro, shard))
            distill_loss = aggregate_loss(distill.to(log_prob.dtype), mask, cfg.agg, **norm)
            loss = loss + cfg.distillation_coef * distill_loss
            metrics["total/distillation_loss"] = distill_loss.detach().clone()
        return loss * scale, metrics

    def _top_k_forward_kl(self, micro: ModelInputs, shard: torch.Tensor) -> torch.Tensor:
        """`[b, R]`: at each response position, KL(teacher's top-k || student) = sum over the teacher's k tokens of
        p_t (log p_t - log p_s), the student's log-probs read at the teacher's ids from its vocab-parallel logits
        (`shard`, at the sampling temperature, as the teacher's were). 0 off the response tokens."""
        rows, cols = micro.response_token_positions()
        teacher_log_probs = micro.extras["teacher_top_log_probs"][rows, cols].to(torch.float32)
        ids = micro.extras["teacher_top_ids"][rows, cols].long()
        student_log_probs = vocab_parallel_log_probs_at(shard, ids, self.backend.ctx.tp_group)
        per_token = (teacher_log_probs.exp() * (teacher_log_probs - student_log_probs)).sum(-1)
        return micro.scatter_response_tokens(per_token)

    def _full_reverse_kl(self, micro: ModelInputs, shard: torch.Tensor) -> torch.Tensor:
        """`[b, R]`: at each response position, KL(student || teacher) over the whole vocabulary, from the student's
        vocab-parallel logits (`shard`, at the sampling temperature, padded ids masked) and the columns of the
        teacher's table (`TEACHER_FULL_KEY`, the student's real ids) this rank's shard holds. 0 off the response
        tokens."""
        ctx = self.backend.ctx
        rows, cols = micro.response_token_positions()
        width = shard.shape[-1]
        start = ctx.tp_rank * width
        target = micro.extras[TEACHER_FULL_KEY][rows, cols, start:start + width].to(torch.float32)
        if target.shape[-1] < width:  # the padded ids past the vocabulary: no mass, any target
            target = torch.nn.functional.pad(target, (0, width - target.shape[-1]))
        per_token = vocab_parallel_reverse_kl(shard, target, ctx.tp_group)
        return micro.scatter_response_tokens(per_token)

