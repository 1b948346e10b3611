"""One training step as a schedule of worker calls: generate and score (with DAPO's dynamic sampling and ReMax's
greedy baseline), the log-prob, reference, teacher and value passes, the advantages, the updates, the weight sync.

One step, as data moves (docs/architecture.md):
  prompts --rollout mesh--> generate (n samples, vLLM)        [gen]
  rewards on the controller (rule scorers / user function)    [reward]
  --train DP--> old log-probs (+entropy) | ref log-probs | values    [old_log_prob, ref, values]
  KL in reward or as loss -> advantages (hybridrl.algorithms)  [adv]
  --train DP--> critic update | actor update                   [update_critic, update_actor]
  actor -> vLLM weight sync, proven by checksums + log-prob probe   [sync]
Every phase is timed (`timing_s/<phase>`).

The step reads the worker groups of a `WorkerTopology` and the run's state (`RunState`: the step number, the phase
running now, the KL controller); it keeps none of its own between steps. The loop around it (`trainer.Trainer.fit`)
owns the data, the checkpoints, validation and restarts.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hybridrl.algorithms import masked_mean
from hybridrl.algorithms.distillation import TEACHER_FULL_KEY, TEACHER_TOP_K_KEYS
from hybridrl.algorithms.kl_control import FixedKLController
from hybridrl.algorithms.names import GREEDY_BASELINE_ADV_ESTIMATORS
from hybridrl.config.plan import Plan
from hybridrl.controller.dispatch import dispatch_order, dp_token_imbalance, row_tokens
from hybridrl.controller.worker_group import WorkerGroup
from hybridrl.data.batch import Batch
from hybridrl.data.dataloader import unpadded_prompt_ids
from hybridrl.names import Phase, Role
from hybridrl.rewards.manager import RewardManager, extra_metrics, reward_metrics, token_level_rewards
from hybridrl.rollout.sampling import RolloutSampling, validation_sampling
from hybridrl.trainer.part_metrics import merge_part_metrics
from hybridrl.trainer.rl_step import (
    AdvantageSettings,
    add_distillation_advantages,
    add_turn_scores,
    apply_kl_in_reward,
    baseline_per_row,
    compute_batch_advantages,
    count_groups_with_spread,
    overlong_penalty,
    response_lengths,
    response_metrics,
    rollout_log_prob_gap,
    select_groups_with_spread,
)
from hybridrl.trainer.timing import PhaseTimer, throughput_metrics
from hybridrl.trainer.topology import WorkerTopology
from hybridrl.workers.backends import UpdateMetrics
from hybridrl.workers.colocated import ColocatedPolicyWorker
from hybridrl.workers.critic import CriticWorker
from hybridrl.workers.frozen_roles import RewardModelWorker, TeacherWorker
from hybridrl.workers.policy import PolicyWorker

PAD_UID_PREFIX = "__pad__"


@dataclass
class RunState:
    """What the step and the loop around it share: the step training now (its sampling seed, its checkpoint), the
    phase running now (a failure names it), and the KL controller (adapted each step, checkpointed)."""

    kl_controller: FixedKLController
    global_step: int = 0
    phase: Phase = Phase.START

    def checkpoint_state(self) -> dict[str, Any]:
        """The run's part of a checkpoint's trainer state: the KL coefficient and its controller's settings (whether
        a resume takes the coefficient back)."""
        return {"kl_coef": float(self.kl_controller.value), "kl_ctrl": self.kl_controller.settings()}

    def restore(self, state: Mapping[str, Any]) -> str | None:
        """Continue from a checkpoint's trainer state: its step, and its KL coefficient where that is state (an
        adaptive controller's; a fixed coefficient is this job's setting: `FixedKLController.resume`). Returns a
        line saying which coefficient applies when the checkpoint's is not taken, else None."""
        note = self.kl_controller.resume(state.get("kl_coef"), state.get("kl_ctrl"))
        self.global_step = int(state["global_step"])
        return note


class StepRunner:
    """The schedule of one step's worker calls on `workers`, scoring with `reward` (or the reward model's group);
    `next_prompts` draws more prompts for dynamic sampling."""

    def __init__(self, plan: Plan, workers: WorkerTopology, reward: RewardManager, tokenizer: Any, run: RunState,
                 next_prompts: Callable[[], Batch]) -> None:
        self.plan = plan
        self.config = plan.config
        self.workers = workers
        self.reward = reward
        self.tokenizer = tokenizer
        self.run = run
        self.next_prompts = next_prompts

    def greedy_sampling(self) -> RolloutSampling:
        """One greedy response per prompt (validation by default, ReMax's baseline)."""
        return validation_sampling(self.plan.resolved.response_length,
                                   stop_token_ids=tuple(self.config.actor_rollout_ref.rollout.stop_token_ids))

    def sampling(self, validation: bool = False, step: int | None = None) -> RolloutSampling:
        """The training step's sampling (its own seed: `step`, else the step training now), or validation's."""
        rollout = self.config.actor_rollout_ref.rollout
        max_tokens = self.plan.resolved.response_length
        stops = tuple(rollout.stop_token_ids)
        if validation:
            vk = rollout.val_kwargs
            if not vk.do_sample or vk.temperature == 0:
                return self.greedy_sampling()
            return RolloutSampling(n=vk.n, temperature=vk.temperature, top_p=vk.top_p,
                                   top_k=vk.top_k if vk.top_k > 0 else None, max_tokens=max_tokens,
                                   stop_token_ids=stops)
        # A seed per step (not per engine call): a resumed run samples step k+1 exactly like the
        # uninterrupted one, whatever the engines' call counters say.
        step = self.run.global_step if step is None else step  # an async rollout draws ahead of the trainer
        step_seed = (self.config.trainer.seed * 1_000_003 + rollout.seed * 7919 + step) % (2**31)
        return RolloutSampling(n=rollout.n, temperature=rollout.temperature, top_p=rollout.top_p,
                               top_k=rollout.top_k if rollout.top_k > 0 else None, max_tokens=max_tokens,
                               stop_token_ids=stops, ignore_eos=rollout.ignore_eos, seed=step_seed)

    @contextmanager
    def timed(self, timer: PhaseTimer, name: Phase) -> Iterator[None]:
        """Time a phase and remember it, so a failure inside it is reported with its name."""
        self.run.phase = name
        with timer.phase(name):
            yield

    def generate(self, prompts: Batch, sampling: RolloutSampling) -> Batch:
        """Samples for every prompt, over the rollout replicas; rows prompt-major, n per prompt."""
        replicas = self.workers.rollout_mesh.dp_size
        padded, pad = prompts.pad_to_multiple(replicas)
        if pad:  # padding rows repeat real prompts: give them their own uids, drop their samples after
            uids = np.array(padded["uid"], dtype=object)
            uids[len(prompts):] = [f"{PAD_UID_PREFIX}{i}" for i in range(pad)]
            padded["uid"] = uids
        padded["raw_prompt_ids"] = unpadded_prompt_ids(padded)
        per_replica = self.workers.rollout_group.call_by_dp_outputs(self.workers.generate_method, padded, sampling,
                                                                  mesh=self.workers.rollout_mesh)
        # each replica measured its own share; the replicas generate at the same time
        replica_metrics = [replica.meta.pop("metrics", None) or {} for replica in per_replica]
        out = Batch.concat(per_replica)
        out.meta["metrics"] = merge_part_metrics(replica_metrics, [len(r) for r in per_replica], concurrent=True)
        if pad:
            keep = [i for i, uid in enumerate(out["uid"]) if not str(uid).startswith(PAD_UID_PREFIX)]
            out = out.index(keep)
        return out

    def score(self, batch: Batch) -> dict[str, float]:
        """token_level_scores: the reward model's score when enabled, else the rule/user scorer's;
        plus DAPO's overlong penalty when enabled, all on each response's last token; plus, with
        multi-turn per-turn rewards, each model turn's reward on that turn's last token."""
        metrics: dict[str, float] = {}
        if self.workers.reward_model is not None:
            scores = self.workers.reward_model.call_by_dp(RewardModelWorker.compute_rm_score, batch,
                                              balance_mini_batches=self._balance(),
                                              keep_together=self._keep_together(Role.REWARD_MODEL)).tensor("rm_scores")
            metrics["reward/rm_score_mean"] = float(scores.float().mean())
            token_scores = token_level_rewards(scores, batch.tensor("response_mask"))
        else:
            token_scores, output = self.reward.score_batch(batch, self.tokenizer)
            metrics.update({f"reward/{k.removeprefix('reward/')}": float(v) for k, v in output.metrics.items()})
            batch.meta["reward_output"] = output  # dynamic sampling's metrics over all rounds read it
            batch[REWARD_EXTRA_INFO] = output.details  # each sample's extra keys, for the rollout dump
        overlong = self.config.algorithm.overlong_buffer
        if overlong.enable:
            lengths = response_lengths(batch)  # the whole response: observation tokens fill the budget too
            end = overlong.max_response_length or self.config.data.max_response_length
            penalty = overlong_penalty(lengths, end, overlong.len, overlong.penalty_factor)
            token_scores = token_scores + token_level_rewards(penalty, batch["response_mask"])
            metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
        token_scores, turn_metrics = add_turn_scores(token_scores, batch)  # multi-turn per-turn rewards
        metrics.update(turn_metrics)
        batch["token_level_scores"] = token_scores
        return metrics

    def _generate_and_score(self, prompts: Batch, timer: PhaseTimer, metrics: dict[str, float]) -> Batch:
        with self.timed(timer, Phase.GEN):
            batch = self.generate(prompts, self.sampling())
        metrics.update(batch.meta.pop("metrics", {}) or {})
        with self.timed(timer, Phase.REWARD):
            metrics.update(self.score(batch))
        if self.config.algorithm.adv_estimator in GREEDY_BASELINE_ADV_ESTIMATORS:
            metrics.update(self._greedy_baseline(prompts, batch, timer))
        return batch

    def _greedy_baseline(self, prompts: Batch, batch: Batch, timer: PhaseTimer) -> dict[str, float]:
        """ReMax: one greedy response per prompt, scored by the same reward as the samples (scorer or
        reward model, overlong penalty); its score is the baseline of every sample of that prompt."""
        with self.timed(timer, Phase.GEN_BASELINE):
            greedy = self.generate(prompts, self.greedy_sampling())
        with self.timed(timer, Phase.REWARD_BASELINE):
            self.score(greedy)
        greedy_scores = greedy.tensor("token_level_scores").sum(-1)
        batch["baseline_scores"] = baseline_per_row(batch.column("uid"), greedy.column("uid"), greedy_scores)
        return {"reward/greedy_baseline_mean": float(greedy_scores.float().mean())}

    def _dynamic_sampling(self, batch: Batch, first_round: dict[str, float], timer: PhaseTimer,
                          metrics: dict[str, float]) -> Batch:
        """DAPO: keep groups whose samples scored differently; generate more prompts to fill the batch.

        After `max_num_gen_batches` generation rounds, groups without spread fill what is missing
        (their advantage is 0): the step's batch arithmetic needs exactly train_batch_size groups.
        The generation and reward metrics cover every round (`merge_part_metrics`).
        """
        groups_needed = self.config.data.train_batch_size
        rounds = self.config.algorithm.filter_groups.max_num_gen_batches
        generated, round_metrics = [batch], [first_round]
        while len(generated) < rounds and count_groups_with_spread(generated) < groups_needed:
            round_metrics.append({})
            generated.append(self._generate_and_score(self.next_prompts(), timer, round_metrics[-1]))
        merged = merge_part_metrics(round_metrics, [len(b) for b in generated])
        outputs = [b.meta.pop("reward_output", None) for b in generated]
        if all(output is not None for output in outputs):  # the scorer's figures over every sample it scored
            sources = [str(source) for b in generated
                       for source in (b["data_source"] if "data_source" in b else ["unknown"] * len(b))]
            merged.update(reward_metrics([x for o in outputs for x in o.scores],
                                         [a for o in outputs for a in o.accs], sources))
            merged.update(extra_metrics([d for o in outputs for d in o.details]))
        metrics.update(merged)
        selected, zero_spread_used = select_groups_with_spread(generated, groups_needed)
        groups_generated = sum(len(set(b["uid"])) for b in generated)
        metrics["dynamic_sampling/generation_rounds"] = float(len(generated))
        metrics["dynamic_sampling/groups_generated"] = float(groups_generated)
        metrics["dynamic_sampling/groups_dropped"] = float(groups_generated - len(set(selected["uid"])))
        metrics["dynamic_sampling/zero_spread_groups_used"] = float(zero_spread_used)
        return selected

    def step(self, prompts: Batch) -> dict[str, float]:
        """One synchronous step: generate and score `prompts`' samples, then train on them and sync."""
        timer = PhaseTimer()
        metrics: dict[str, float] = {}
        batch = self.sampled_batch(prompts, timer, metrics)
        return self.train_on(batch, timer, metrics, lambda: self.workers.sync_weights(self.run.global_step))

    def sampled_batch(self, prompts: Batch, timer: PhaseTimer, metrics: dict[str, float]) -> Batch:
        """The scored samples of `prompts` (with dynamic sampling, of as many more prompts as it takes)."""
        generation_metrics: dict[str, float] = {}
        batch = self._generate_and_score(prompts, timer, generation_metrics)
        if self.config.algorithm.filter_groups.enable:
            batch = self._dynamic_sampling(batch, generation_metrics, timer, metrics)
        else:
            metrics.update(generation_metrics)
        batch.meta.pop("reward_output", None)  # the controller's; the workers need none of it
        return batch

    def train_on(self, batch: Batch, timer: PhaseTimer, metrics: dict[str, float],
                 sync: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Old/ref log-probs, values, advantages and the updates on a scored batch, then `sync` (the
        weights into the rollout); the step's metrics."""
        resolved, workers = self.plan.resolved, self.workers
        if resolved.free_cache_engine:
            with self.timed(timer, Phase.RELEASE_ROLLOUT_MEMORY):
                workers.actor_group.call_all(ColocatedPolicyWorker.release_rollout_memory)
        batch.meta["temperature"] = self.config.actor_rollout_ref.rollout.temperature
        if resolved.old_log_prob_pass:  # else the update's forward is the old policy (on-policy)
            with self.timed(timer, Phase.OLD_LOG_PROB):
                metrics.update(self._old_log_probs(batch))
        if resolved.ref_enabled:
            with self.timed(timer, Phase.REF):
                metrics.update(self._ref_log_probs(batch))
        if workers.teacher is not None:
            with self.timed(timer, Phase.TEACHER):
                metrics.update(self._teacher_log_probs(batch, workers.teacher))
        if workers.critic is not None:
            with self.timed(timer, Phase.VALUES):
                batch["values"] = workers.critic.call_by_dp(
                    CriticWorker.compute_values, batch, balance_mini_batches=self._balance(),
                    keep_together=self._keep_together(Role.CRITIC)).tensor("values")
        with self.timed(timer, Phase.ADV):
            metrics.update(self._advantages(batch))
        if workers.critic is not None:
            with self.timed(timer, Phase.UPDATE_CRITIC):
                outs = workers.critic.call_by_dp_outputs(
                    CriticWorker.update_critic, batch, balance_mini_batches=self._balance((Role.CRITIC, batch)),
                    keep_together=self._keep_together(Role.CRITIC))
                metrics.update(_update_metrics(outs))
        with self.timed(timer, Phase.UPDATE_ACTOR):
            balance = self._balance((Role.ACTOR, batch))
            outs = workers.actor_group.call_by_dp_outputs(PolicyWorker.update_actor, batch,
                                                          balance_mini_batches=balance,
                                                          keep_together=self._keep_together(Role.ACTOR))
            metrics.update(_update_metrics(outs))
            metrics["perf/dp_token_imbalance"] = self._dp_imbalance(Role.ACTOR, batch, balance)
        with self.timed(timer, Phase.SYNC):
            metrics.update(sync())
        metrics.update(self._step_metrics(batch, timer))
        return metrics

    def _old_log_probs(self, batch: Batch) -> dict[str, float]:
        """The actor's log-probs of the sampled tokens (and entropies) into `batch`; how the pass went, and how far the
        rollout's own log-probs are from them (a numerics and sync health check)."""
        old = self.workers.actor_group.call_by_dp(PolicyWorker.compute_log_prob, batch, with_entropy=True,
                                                  balance_mini_batches=self._balance(),
                                                  keep_together=self._keep_together(Role.ACTOR))
        batch["old_log_probs"] = old["old_log_probs"]
        metrics = {"perf/padding_ratio_old_log_prob": float(old.meta.get("padding_ratio", 0.0)),
                   "perf/shared_prefix_ratio_old_log_prob": float(old.meta.get("shared_prefix_ratio", 0.0))}
        if "router_replay_mismatch" in old.meta:  # actor.router_replay: rollout
            metrics["actor/router_replay_mismatch_old_log_prob"] = float(old.meta["router_replay_mismatch"])
        mask = batch.tensor("response_mask").float()
        if "old_log_probs_truncated" in old.tensors:  # rollout_correction.match_truncation
            batch["old_log_probs_truncated"] = old["old_log_probs_truncated"]
            # sampled tokens the trainer's own top-k/top-p drops (boundary disagreements)
            metrics["rollout_correction/truncation_outside_fraction"] = float(
                (old.tensor("old_log_probs_outside").float() * mask).sum() / mask.sum().clamp(min=1))
        metrics["actor/entropy"] = float(masked_mean(old.tensor("entropys"), mask))
        metrics.update(rollout_log_prob_gap(old.tensor("old_log_probs"), batch.tensor("rollout_log_probs"), mask))
        return metrics

    def _ref_log_probs(self, batch: Batch) -> dict[str, float]:
        ref = self.workers.actor_group.call_by_dp(PolicyWorker.compute_ref_log_prob, batch,
                                                  balance_mini_batches=self._balance(),
                                                  keep_together=self._keep_together(Role.REF))
        batch["ref_log_probs"] = ref["ref_log_probs"]
        return {"perf/padding_ratio_ref_log_prob": float(ref.meta.get("padding_ratio", 0.0)),
                "perf/shared_prefix_ratio_ref_log_prob": float(ref.meta.get("shared_prefix_ratio", 0.0))}

    def _teacher_log_probs(self, batch: Batch, teacher_group: WorkerGroup) -> dict[str, float]:
        """On-policy distillation: the teacher's log-probs of the sampled tokens (top_k_forward_kl /
        full_reverse_kl: also its distribution, for the update's loss term) into `batch`."""
        teacher = teacher_group.call_by_dp(TeacherWorker.compute_teacher_log_prob, batch,
                                           balance_mini_batches=self._balance(),
                                           keep_together=self._keep_together(Role.TEACHER))
        batch["teacher_log_probs"] = teacher["teacher_log_probs"]
        for key in (*TEACHER_TOP_K_KEYS, TEACHER_FULL_KEY):
            if key in teacher.tensors:
                batch[key] = teacher[key]
        return {"perf/padding_ratio_teacher_log_prob": float(teacher.meta.get("padding_ratio", 0.0))}

    def _advantages(self, batch: Batch) -> dict[str, float]:
        """The token rewards (with the KL penalty when it is in the reward) and the advantages: the estimator's,
        the distillation's, or both."""
        algorithm = self.config.algorithm
        metrics: dict[str, float] = {}
        if algorithm.use_kl_in_reward:
            metrics.update(apply_kl_in_reward(batch, self.run.kl_controller, algorithm.kl_penalty))
        else:
            batch["token_level_rewards"] = batch["token_level_scores"]
        distillation = algorithm.distillation
        if not distillation.enable or distillation.task_reward:
            compute_batch_advantages(batch, AdvantageSettings(algorithm.adv_estimator, algorithm.gamma, algorithm.lam,
                                                              algorithm.norm_adv_by_std_in_grpo))
        if distillation.enable:
            # the sampled-token reverse KL: the advantage (sampled_reverse_kl), else a metric beside the update's
            # top-k or full-vocabulary loss term
            metrics.update(add_distillation_advantages(
                batch, distillation.kl_coef, with_task_reward=distillation.task_reward,
                in_advantage=distillation.loss == "sampled_reverse_kl"))
        return metrics

    def _step_metrics(self, batch: Batch, timer: PhaseTimer) -> dict[str, float]:
        """What the trained batch says of the step: its responses, the phases' times, the throughput (and the batch
        itself written out with `trainer.rollout_data_dir`)."""
        metrics = response_metrics(batch)
        if self.config.trainer.rollout_data_dir:
            self._dump_rollout(batch, Path(self.config.trainer.rollout_data_dir))
        metrics.update(timer.metrics())
        tokens = int(batch.tensor("attention_mask").sum())
        metrics.update(throughput_metrics(tokens, len(batch), metrics["timing_s/step"],
                                          self.plan.resolved.total_ranks))
        return metrics

    def _update_mini_batches(self, role: str, batch: Batch) -> int:
        """The global mini-batches of one epoch of `role`'s update on `batch` (each rank cuts its chunk
        into this many)."""
        per_rank = self.plan.update(role).sequences_per_rank_per_mini_batch
        return max(1, len(batch) // (per_rank * self.plan.layout(role).mesh.dp))

    def _balance(self, update: tuple[str, Batch] | None = None) -> int | None:
        """`balance_mini_batches` for a DP call (None: the plain split, `trainer.balance_batch` off). A
        forward pass balances the whole batch; an `update` (its role, its batch) each of its mini-batches."""
        if not self.config.trainer.balance_batch:
            return None
        return 1 if update is None else self._update_mini_batches(*update)

    def _keep_together(self, role: str) -> str | None:
        """`keep_together` for a DP call of `role`: `uid` where its workers compute a shared prompt once
        (`model.shared_prefix`), so the balanced dispatch deals GRPO's groups whole; else None."""
        return "uid" if self.plan.resolved.shared_prefix(role) else None

    def _dp_imbalance(self, role: str, batch: Batch, balance: int | None) -> float:
        """`perf/dp_token_imbalance` of `role`'s update dispatch: heaviest rank's real tokens / the mean,
        summed over the mini-batches (1.0 = even)."""
        dp, minis = self.plan.layout(role).mesh.dp, self._update_mini_batches(role, batch)
        order = None if balance is None else dispatch_order(batch, dp, balance, self._keep_together(role))
        return dp_token_imbalance(row_tokens(batch), dp, minis, order)

    def _dump_rollout(self, batch: Batch, out_dir: Path) -> None:
        """`trainer.rollout_data_dir`: one JSON line per trained sample of this step, in batch order."""
        out_dir.mkdir(parents=True, exist_ok=True)
        prompt_width = batch.tensor("input_ids").shape[1] - batch.tensor("responses").shape[1]
        response_mask = batch.tensor("response_mask").bool()
        prompt_mask = batch.tensor("attention_mask")[:, :prompt_width].bool()
        # every token after the prompt: a multi-turn conversation's observations too (not trained)
        attended = batch.tensor("attention_mask")[:, prompt_width:].bool()
        per_sequence = {key: (batch[key] * response_mask).sum(-1).tolist()
                        for key in ("token_level_scores", "token_level_rewards") if key in batch}
        lines = []
        for row in range(len(batch)):
            response_ids = batch["responses"][row][attended[row]].tolist()
            trained = response_mask[row][attended[row]]
            record = {
                "step": self.run.global_step, "uid": batch["uid"][row],
                "prompt_ids": batch["input_ids"][row, :prompt_width][prompt_mask[row]].tolist(),
                "response_ids": response_ids, "response_length": len(response_ids),
                "response": self.tokenizer.decode(response_ids, skip_special_tokens=True),
                "ground_truth": batch["ground_truth"][row] if "ground_truth" in batch else None,
                "score": per_sequence["token_level_scores"][row],
                "reward": per_sequence.get("token_level_rewards", per_sequence["token_level_scores"])[row],
                # outcome estimators give every response token the same advantage; GAE's first one
                "advantage": float(batch["advantages"][row][response_mask[row]][0]) if bool(trained.any()) else 0.0,
            }
            if "num_turns" in batch:  # multi-turn: which tokens the model wrote, its turns and tool calls
                record.update(model_token_mask=trained.int().tolist(), num_turns=batch["num_turns"][row],
                              tool_calls=batch["tool_calls"][row], tool_errors=batch["tool_errors"][row])
            if "baseline_scores" in batch:  # ReMax: the score of the prompt's greedy response
                record["baseline"] = float(batch["baseline_scores"][row])
            if REWARD_EXTRA_INFO in batch:  # the scorer's extra keys (a dict result's beside score and acc)
                record[REWARD_EXTRA_INFO] = batch[REWARD_EXTRA_INFO][row]
            lines.append(json.dumps(record, default=_json_default))
        (out_dir / f"step_{self.run.global_step}.jsonl").write_text("\n".join(lines) + "\n")


# the batch column (and the dumps' key) of each sample's extra reward keys: verl's name for them
REWARD_EXTRA_INFO = "reward_extra_info"


def _json_default(value: Any) -> Any:
    """numpy scalars and other metadata values in a rollout dump line."""
    return value.item() if hasattr(value, "item") else str(value)


def _update_metrics(outs: list[UpdateMetrics | None]) -> dict[str, float]:
    """An update's metrics from its DP output ranks (each trained role's the same type, `UpdateMetrics`)."""
    return _mean_dicts([out.as_dict() for out in outs if out is not None])


def _mean_dicts(items: list[dict[str, Any] | None]) -> dict[str, float]:
    """Mean over DP ranks of each numeric metric (ranks report equal values for global ones)."""
    numeric: dict[str, list[float]] = {}
    for item in items:
        for key, value in (item or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                numeric.setdefault(key, []).append(float(value))
    return {key: float(np.mean(values)) for key, values in numeric.items()}
