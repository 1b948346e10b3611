"""The independent reference of the megatron actor's PPO step: transformers + plain torch, written here (nothing from
`hybridrl.algorithms`), and the megatron side run in forked ranks with its gradients read back under HF names.

tests/training/test_actor_reference.py says what it checks and why; the model, LoRA, packing, shared-prefix,
distillation, multi-turn and real-layout tests compare against the same reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.support.forked import run_ranks
from tests.support.models_fixtures import safetensors_state
from tests.support.training_fixtures import RESPONSE, job_config, rollout_batch

TEMPERATURE = 0.7
CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # DAPO's clip-higher: asymmetric on purpose
DUAL_CLIP = 2.0  # low enough that some negative-advantage tokens exceed it
ENTROPY_COEFF = 0.05
KL_COEF = 0.3
# Llama with GQA, vocab 200 (megatron pads it), untied; weights with a wider spread than HF's init
# (rollout_models.randomize) so the logits are far from uniform and the temperature matters.
POLICY = dict(family="llama", vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
# fp32; megatron's log-probs equal transformers' to ~1e-6, the gradients to ~1e-6 of their size
GRAD_RTOL = 1e-5
SCALAR_RTOL = 1e-5  # of the value, or absolute below 1 (token-sum losses are sums)


@dataclass(frozen=True)
class Case:
    loss_agg_mode: str
    kl_loss_type: str  # the config's spelling; k1 = "kl", k3 = "low_var_kl"
    # algorithm.rollout_correction (off by default)
    is_level: str = "none"
    is_cap: float = 2.0
    mask_level: str = "none"
    mask_low: float = 0.5
    mask_high: float = 2.0

    @property
    def kl_kind(self) -> str:
        return {"kl": "k1", "k1": "k1", "low_var_kl": "k3", "k3": "k3"}[self.kl_loss_type]


# Every aggregation mode, each KL estimator under several of them.
CASES = (
    Case("token-mean", "low_var_kl"),
    Case("token-sum", "kl"),
    Case("seq-mean-token-sum", "k3"),
    Case("seq-mean-token-mean", "kl"),
    Case("seq-mean-token-sum-norm", "low_var_kl"),
)


# ---- the reference, in plain torch ------------------------------------------------------------------
def correction_weight(batch: Any, case: Case, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The rollout-mismatch correction of each token's PG loss: (IS weight, keep) `[B, R]`. The weight
    is min(rho, C) of the token's rho = pi_old / mu or of the product over its sequence (1 without
    IS); keep is whether the token's rho, its sequence's product or their geometric mean lies in
    [low, high] (all True without a mask)."""
    mask = batch["response_mask"].to(dtype)
    log_rho = (batch["old_log_probs"].to(dtype) - batch["rollout_log_probs"].to(dtype)) * mask
    seq_log = log_rho.sum(-1, keepdim=True)
    levels = {"token": log_rho.exp(), "sequence": seq_log.exp().expand_as(log_rho),
              "geometric": (seq_log / mask.sum(-1, keepdim=True).clamp(min=1)).exp().expand_as(log_rho)}
    weight = torch.ones_like(log_rho) if case.is_level == "none" else levels[case.is_level].clamp(max=case.is_cap)
    keep = torch.ones_like(mask, dtype=torch.bool)
    if case.mask_level != "none":
        level = levels[case.mask_level]
        keep = (level >= case.mask_low) & (level <= case.mask_high)
    return weight, keep


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce a `[B, R]` loss over the whole mini-batch (T_norm of Dr.GRPO: the max response length)."""
    lengths = mask.sum(-1)
    has_tokens = lengths > 0
    seq_sums = (per_token * mask).sum(-1)[has_tokens]
    if mode == "token-mean":
        return (per_token * mask).sum() / mask.sum()
    if mode == "token-sum":
        return (per_token * mask).sum()
    if mode == "seq-mean-token-sum":
        return seq_sums.mean()
    if mode == "seq-mean-token-mean":
        return (seq_sums / lengths[has_tokens]).mean()
    if mode == "seq-mean-token-sum-norm":
        return seq_sums.mean() / RESPONSE
    raise AssertionError(mode)


def response_log_softmax(hf_dir: Path, batch: Any, dtype: torch.dtype = torch.float32,
                         attention: str = "eager", model: Any = None) -> tuple[Any, torch.Tensor]:
    """The transformers model (`model`, else loaded from `hf_dir`) and its tempered log-softmax `[B, R, V]` at each
    response position.

    (In float64, eager attention turns fully masked padding rows into NaN: use "sdpa" there.)
    """
    import transformers

    if model is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, attn_implementation=attention)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits
    width = batch["input_ids"].shape[1]
    return model, (logits[:, width - RESPONSE - 1: width - 1] / TEMPERATURE).log_softmax(-1)


def reference_step(hf_dir: Path, batch: Any, case: Case, dtype: torch.dtype = torch.float32,
                   attention: str = "eager", model: Any = None) -> dict[str, Any]:
    """Loss terms, metrics and per-tensor gradients of one PPO step, from transformers' forward (of `model`, e.g. a
    peft model, else loaded from `hf_dir`); the gradients of the parameters that get one."""
    model, log_softmax = response_log_softmax(hf_dir, batch, dtype, attention, model)
    log_prob = log_softmax.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    mask = batch["response_mask"].to(dtype)
    valid = mask.bool()
    adv, old, ref = (batch[key].to(dtype) for key in ("advantages", "old_log_probs", "ref_log_probs"))

    ratio = torch.exp(log_prob - old)
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
    token_loss = torch.where(adv < 0, torch.minimum(surrogate, -adv * DUAL_CLIP), surrogate)
    is_weight, keep = correction_weight(batch, case, dtype)
    token_loss = token_loss * is_weight * keep  # masked tokens stay in the denominators of `aggregate`
    clipped = ((adv > 0) & (ratio > 1 + CLIP_HIGH)) | ((adv < 0) & (ratio < 1 - CLIP_LOW))
    dual_clipped = (adv < 0) & (ratio > DUAL_CLIP)

    log_ratio = log_prob - ref  # log pi / pi_ref on the policy's samples
    kl = log_ratio if case.kl_kind == "k1" else torch.exp(-log_ratio) + log_ratio - 1

    mode = case.loss_agg_mode
    pg_loss = aggregate(token_loss, mask, mode)
    kl_loss = aggregate(kl, mask, mode)
    loss = pg_loss - ENTROPY_COEFF * aggregate(entropy, mask, mode) + KL_COEF * kl_loss
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        masked = valid & ~keep
        log_rho = old - batch["rollout_log_probs"].to(dtype)
        corrected = {
            "rollout_correction/log_ratio_abs_max": float(log_rho[valid].abs().max()),
            "rollout_correction/is_weight_mean": float(is_weight[valid].mean()),
            "rollout_correction/is_weight_max": float(is_weight[valid].max()),
            "rollout_correction/masked_token_fraction": float(masked.sum() / valid.sum()),
            "rollout_correction/masked_seq_fraction": float(masked.any(-1).sum() / valid.any(-1).sum()),
        }
        names = ["log_ratio_abs_max"] * (case.is_level != "none" or case.mask_level != "none")
        names += ["is_weight_mean", "is_weight_max"] * (case.is_level != "none")
        names += ["masked_token_fraction", "masked_seq_fraction"] * (case.mask_level != "none")
        return {
            "pg_loss": float(pg_loss), "kl_loss": float(kl_loss), "loss": float(loss),
            "is_capped": float((is_weight[valid] == case.is_cap).float().mean()) if case.is_level != "none" else 0.0,
            "masked": float(masked.sum()),
            "rollout_correction": {f"rollout_correction/{n}": corrected[f"rollout_correction/{n}"] for n in names},
            "clipfrac": float(clipped[valid].float().mean()),
            "clipfrac_lower": float(dual_clipped[valid].float().mean()),
            "approx_kl": float((old - log_prob)[valid].mean()),
            "entropy": float(entropy[valid].mean()),
            "grad_norm": float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))),
            "grads": grads,
        }


def ppo_batch(hf_dir: Path, rows: int = 8, seed: int = 11, vocab: int = POLICY["vocab_size"],
              groups: list[int] | None = None) -> Any:
    """Rollout-shaped rows whose old and reference log-probs are the tempered policy's, perturbed.

    The perturbation (uniform in [-1, 1] nats) puts ratios in [0.37, 2.7]: both clip bounds and the
    dual clip are crossed. Advantages have both signs. `groups`: rows sharing prompts (`rollout_batch`).
    """
    batch = rollout_batch(rows, seed=seed, vocab=vocab, groups=groups)
    with torch.no_grad():
        _, log_softmax = response_log_softmax(hf_dir, batch)
    policy = log_softmax.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    gen = torch.Generator().manual_seed(seed + 1)
    mask = batch["response_mask"].float()
    shape = policy.shape
    batch["old_log_probs"] = (policy + 2 * torch.rand(shape, generator=gen) - 1) * mask
    batch["ref_log_probs"] = (policy + 0.6 * torch.rand(shape, generator=gen) - 0.3) * mask
    batch["advantages"] = torch.randn(shape, generator=gen) * mask
    # the behaviour policy: the old one perturbed by up to 1 nat, so rho spans [0.37, 2.7]
    batch["rollout_log_probs"] = (batch["old_log_probs"] + 2 * torch.rand(shape, generator=gen) - 1) * mask
    batch.meta["temperature"] = TEMPERATURE
    return batch


# ---- megatron, on forked ranks ----------------------------------------------------------------------
def gradients_into_params(backend: Any) -> None:
    """Overwrite every parameter with its reduced gradient (DDP's `main_grad`), for the bridge's export.

    With the distributed optimizer each DP rank holds only its shard of each bucket reduced: gather
    the shards first.
    """
    import torch.distributed as dist

    for model in backend.models:
        if model.ddp_config.use_distributed_optimizer:
            for group in model.bucket_groups:
                size = group.intra_distributed_optimizer_instance_size
                rank = group.intra_distributed_optimizer_instance_rank
                for bucket in group.buckets:
                    shard = bucket.grad_data.numel() // size
                    mine = bucket.grad_data[rank * shard:(rank + 1) * shard].clone()
                    parts = [torch.empty_like(mine) for _ in range(size)]
                    dist.all_gather(parts, mine, group=group.intra_distributed_optimizer_instance_group)
                    bucket.grad_data.copy_(torch.cat(parts))
        with torch.no_grad():
            for param in model.module.parameters():
                param.copy_(param.main_grad)


def actor_step_rank(rank: int, world: int, configs: list[Any], batch: Any, out_dirs: list[str]) -> list[Any]:
    from hybridrl.config.plan import build_plan
    from hybridrl.models.bridge import export_hf
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    results = []
    for config, out_dir in zip(configs, out_dirs):
        plan = build_plan(config)
        backend = MegatronBackend(role_spec(plan, "actor"))
        actor = MegatronActor(backend, plan)
        metrics = actor.update_policy(batch.split(backend.ctx.dp)[backend.ctx.dp_rank])
        gradients_into_params(backend)
        export_hf(backend.chunks, out_dir, force=True)
        results.append(metrics)
    return results


def actor_config(hf: Path, case: Case, *, tp: int = 1, pp: int = 1, dp: int = 1,
                 distributed_optimizer: bool = False, rows: int = 8) -> Any:
    """The job whose actor objective `reference_step` recomputes, on a TP x PP x DP layout."""
    config = job_config(hf, world=tp * pp * dp, tp=tp, pp=pp, distributed_optimizer=distributed_optimizer, rows=rows,
                        loss_agg_mode=case.loss_agg_mode, use_kl_loss=True, kl_loss_coef=KL_COEF,
                        kl_loss_type=case.kl_loss_type, entropy_coeff=ENTROPY_COEFF,
                        clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=DUAL_CLIP)
    config.actor_rollout_ref.actor.optim.clip_grad = 0.0  # the buffers must hold the unclipped gradient
    config.actor_rollout_ref.rollout.temperature = TEMPERATURE
    rc = config.algorithm.rollout_correction
    rc.is_level, rc.is_cap, rc.mask_level = case.is_level, case.is_cap, case.mask_level
    rc.mask_low, rc.mask_high = case.mask_low, case.mask_high
    return config


def megatron_steps(tmp_path: Path, hf: Path, batch: Any, *, tp: int, pp: int, dp: int,
                   distributed_optimizer: bool, cases: tuple[Case, ...] = CASES
                   ) -> list[tuple[Any, dict[str, torch.Tensor]]]:
    """(metrics, HF-named gradients) of one megatron actor step per case, on a TP x PP x DP layout."""
    configs = [actor_config(hf, case, tp=tp, pp=pp, dp=dp, distributed_optimizer=distributed_optimizer,
                            rows=len(batch)) for case in cases]
    out_dirs = [str(tmp_path / f"grads_{tp}{pp}{dp}_{i}") for i in range(len(cases))]
    results = run_ranks(actor_step_rank, tp * pp * dp, configs, batch, out_dirs)
    per_case = list(zip(*results))  # [case][rank]
    out = []
    for metrics_by_rank, out_dir in zip(per_case, out_dirs):
        metrics = [m for m in metrics_by_rank if m is not None]
        assert len(metrics) == dp  # one output rank per DP replica
        out.append((metrics[0], safetensors_state(Path(out_dir))))
    return out


def assert_matches_reference(expected: dict[str, Any], metrics: Any, grads: dict[str, torch.Tensor],
                              label: str) -> None:
    for name in ("pg_loss", "kl_loss", "clipfrac", "clipfrac_lower", "approx_kl", "entropy"):
        value, ref = getattr(metrics, name), expected[name]
        assert abs(value - ref) <= SCALAR_RTOL * max(1.0, abs(ref)), (label, name, value, ref)
    assert abs(metrics.grad_norm - expected["grad_norm"]) <= GRAD_RTOL * expected["grad_norm"], (
        label, metrics.grad_norm, expected["grad_norm"])
    assert sorted(grads) == sorted(expected["grads"]), label
    for name, ref in expected["grads"].items():
        err = float((grads[name] - ref).abs().max())
        scale = float(ref.abs().max())
        assert scale > 0, (label, name)  # every tensor gets a gradient
        assert err <= GRAD_RTOL * scale, (label, name, err, scale)
    expected_correction = expected.get("rollout_correction")
    if expected_correction is not None and hasattr(metrics, "rollout_correction"):
        assert sorted(metrics.rollout_correction) == sorted(expected_correction), (label, metrics.rollout_correction)
        for key, ref in expected_correction.items():
            value = metrics.rollout_correction[key]
            assert abs(value - ref) <= SCALAR_RTOL * max(1.0, abs(ref)), (label, key, value, ref)
