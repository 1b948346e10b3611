"""The controller loop: one process, no weights, driving every worker group through PPO/GRPO steps.

One step, as data moves (docs/architecture.md):
  prompts --rollout mesh--> generate (n samples, vLLM)        [gen]
  rewards on the controller (rule scorers / user function)    [reward]
  --train DP--> old log-probs (+entropy) | ref log-probs | values    [old_log_prob, ref, values]
  KL in reward or as loss -> advantages (hybridrl.algorithms)  [adv]
  --train DP--> critic update | actor update                   [update_critic, update_actor]
  actor -> vLLM weight sync, proven by checksums + log-prob probe   [sync]
Every phase is timed; metrics of the step go to the tracker; checkpoints at `save_freq`.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hybridrl.algorithms import masked_mean
from hybridrl.algorithms.distillation import TEACHER_TOP_K_KEYS
from hybridrl.algorithms.kl_control import kl_controller_from_config
from hybridrl.algorithms.names import GREEDY_BASELINE_ADV_ESTIMATORS
from hybridrl.config.errors import ConfigError, ConfigIssue
from hybridrl.config.hardware import load_hardware
from hybridrl.config.plan import Plan
from hybridrl.config.report import failure_cost_lines
from hybridrl.config.step_time import predict_step_time, time_vs_plan
from hybridrl.controller.base_worker import Worker
from hybridrl.controller.cluster import init_ray
from hybridrl.controller.dispatch import MeshCoord, RankMesh, dispatch_order, dp_token_imbalance, row_tokens
from hybridrl.controller.gather import WorkerGroupError
from hybridrl.controller.resource_pool import ResourcePool, ResourcePoolError
from hybridrl.controller.worker_group import WorkerGroup, wait_together
from hybridrl.data.batch import Batch
from hybridrl.data.dataloader import PromptDataLoader, unpadded_prompt_ids
from hybridrl.data.dataset import DatasetError, PromptDataset
from hybridrl.data.tokenizer import load_tokenizer, resolve_pad_token_id
from hybridrl.names import GroupName, Phase, Role
from hybridrl.parallel.cross_group import CrossGroupAddress
from hybridrl.rewards.custom import RewardFunctionError
from hybridrl.rewards.manager import RewardManager, reward_metrics, token_level_rewards
from hybridrl.rewards.registry import UnknownScorerError
from hybridrl.rollout.sampling import RolloutSampling, validation_sampling
from hybridrl.rollout.turn_rewards import TurnRewardError, turn_rewarder_from_config
from hybridrl.tools import available_parsers, build_registry
from hybridrl.trainer.async_rollout import DriverSettings, RolloutDriver
from hybridrl.trainer.checkpoints import CheckpointError, CheckpointManager
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
from hybridrl.trainer.tracking import Tracker, plot_run, render_summary
from hybridrl.workers.hybrid import HybridEngineWorker, HybridSettings
from hybridrl.workers.policy import DisaggregatedPolicyWorker, PolicyWorker
from hybridrl.workers.ray_roles import CriticWorker, RewardModelWorker, TeacherWorker
from hybridrl.workers.rollout_worker import RolloutWorker

PAD_UID_PREFIX = "__pad__"
VAL_GENERATIONS = "val_generations.jsonl"  # trainer.log_val_generations writes here, in the run dir
# a failed attempt's rollout thread ends once the teardown failed its call in flight (seconds, here); a
# restart waits this long for it before giving up
STOPPED_DRIVER_WAIT_S = 120.0


class TrainingFailure(RuntimeError):
    """Training stopped: which step, which phase, and why (a worker's role, rank and cause when one failed).

    Raised from `Trainer.fit` after the workers are torn down; the last complete checkpoint is
    intact (a save in progress is never the latest), so `trainer.resume_mode=auto` continues from it.
    """

    def __init__(self, step: int, phase: Phase, cause: str) -> None:
        self.step = step
        self.phase = phase
        self.cause = cause
        super().__init__(f"training failed at step {step}, phase {phase}: {cause}")


@contextmanager
def _user_input(field: str, value: Any, *errors: type[Exception]) -> Iterator[None]:
    """Reading a user's file (tokenizer, data, reward code): its failure is the config's error on `field`
    (exit 2, the message, no traceback), not a crash. The plan checked these already; what only a full read
    shows (a malformed row, a tokenizer that will not load) ends here."""
    try:
        yield
    except errors as error:
        raise ConfigError([ConfigIssue(field, value, str(error))]) from error


class NonFiniteGuard:
    """Counts training steps in a row with a skipped optimizer step (NaN/Inf loss or gradients).

    The workers skip such an optimizer step themselves (`hybridrl.training.nonfinite`); a run whose
    steps keep being skipped is not training, so after `limit` in a row (0 = never) it stops.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.consecutive = 0

    def observe(self, metrics: dict[str, float]) -> dict[str, float]:
        skipped = metrics.get("actor/skipped_steps", 0.0) + metrics.get("critic/skipped_steps", 0.0)
        self.consecutive = self.consecutive + 1 if skipped > 0 else 0
        return {"training/consecutive_nonfinite_steps": float(self.consecutive)}

    @property
    def exhausted(self) -> bool:
        return self.limit > 0 and self.consecutive >= self.limit


@dataclass
class RunResult:
    steps: int
    history: list[dict[str, float]] = field(default_factory=list)
    run_dir: Path | None = None
    summary: str = ""


def run_dir_for(plan: Plan) -> Path:
    trainer = plan.config.trainer
    return Path(trainer.run_dir or Path("runs") / trainer.project_name / trainer.experiment_name)


def checkpoint_root_for(plan: Plan) -> Path:
    trainer = plan.config.trainer
    return Path(trainer.default_local_dir) / trainer.project_name / trainer.experiment_name


class Trainer:
    """Builds the data, the reward function and the worker groups from a Plan, then runs `fit()`."""

    def __init__(self, plan: Plan, *, write=print, progress: bool = True) -> None:
        self.plan = plan
        self.config = plan.config
        self.write = write
        self.progress = progress
        self.run_dir = run_dir_for(plan)
        self.checkpoints = CheckpointManager(checkpoint_root_for(plan), plan.config.trainer.keep_last_n)
        self.global_step = 0
        self.phase = Phase.START  # the phase running now: named by a TrainingFailure
        self.cluster = self.pool = self.actor_group = self.critic_group = self.rm_group = self.teacher_group = None
        # disaggregated: vLLM's own pool and group (colocated: rollout_group is the actor group)
        self.rollout_pool = self.rollout_group = None
        self.teacher_pool: ResourcePool | None = None
        hardware = plan.config.trainer.hardware
        # the plan's predicted step (trainer.hardware set): each step logs measured over predicted per phase
        self.predicted_step = predict_step_time(plan, load_hardware(hardware)) if hardware else None
        self.driver: RolloutDriver | None = None  # rollout.async_mode one_step_off / fully_async
        self._stopped_driver: RolloutDriver | None = None  # a failed attempt's, until its thread ended

    # ------------------------------------------------------------------------------ set-up
    def _build_data(self) -> None:

        cfg = self.config
        model = cfg.actor_rollout_ref.model
        tokenizer_field = "actor_rollout_ref.model." + ("tokenizer_path" if model.tokenizer_path else "path")
        with _user_input(tokenizer_field, model.tokenizer_path or model.path, OSError, ValueError):
            self.tokenizer = load_tokenizer(model.tokenizer_path or model.path,
                                            trust_remote_code=model.trust_remote_code)
        # Resolved once here and handed to the workers: prompts, responses and probe rows pad alike.
        self.pad_token_id = resolve_pad_token_id(self.tokenizer, model.path)
        extra: dict[str, Any] = {}
        multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
        if multi_turn.enable:
            # The chat template shows the model its tools (templates without a tools section ignore them).
            extra["tools"] = build_registry(multi_turn.tools, tools_file=multi_turn.tools_file).schemas()
            if multi_turn.tool_parser not in available_parsers():  # none built in, none in the tools file
                raise ConfigError([ConfigIssue(
                    "actor_rollout_ref.rollout.multi_turn.tool_parser", multi_turn.tool_parser,
                    f"is neither built in nor in the TOOL_PARSERS of {multi_turn.tools_file}", available_parsers())])
            try:  # the per-turn reward function is loaded by every worker; a missing one is refused here first
                turn_rewarder_from_config(multi_turn.turn_reward)
            except TurnRewardError as error:
                raise ConfigError([ConfigIssue("actor_rollout_ref.rollout.multi_turn.turn_reward.name",
                                               multi_turn.turn_reward.name, str(error))]) from None
        with _user_input("data.train_files", cfg.data.train_files, DatasetError):
            train = PromptDataset.from_config(cfg.data, cfg.data.train_files, self.tokenizer, **extra)
        self.write(f"train data: {train.stats.summary()}")
        if len(train) < cfg.data.train_batch_size:  # the plan counted rows; filtering and skipping drop some
            raise ConfigError([ConfigIssue(
                "data.train_batch_size", cfg.data.train_batch_size,
                f"is more than the {len(train)} usable prompts of data.train_files ({train.stats.summary()}): not "
                f"one batch; lower it to at most {len(train)}, raise data.max_prompt_length, or add data")])
        self.train_loader = PromptDataLoader(train, cfg.data.train_batch_size, self.pad_token_id,
                                             shuffle=cfg.data.shuffle, seed=cfg.trainer.seed)
        self.val_loader = None
        if cfg.data.val_files:
            with _user_input("data.val_files", cfg.data.val_files, DatasetError):
                val = PromptDataset.from_config(cfg.data, cfg.data.val_files, self.tokenizer, **extra)
            self.write(f"val data: {val.stats.summary()}")  # over-long prompts are counted there too
            self.val_loader = PromptDataLoader(val, cfg.data.val_batch_size or len(val), self.pad_token_id,
                                               shuffle=False, drop_last=False)
        custom = cfg.algorithm.custom_reward_function
        reward_field, reward_value = (("algorithm.custom_reward_function.path", custom.path) if custom.path
                                      else ("algorithm.reward_fn", cfg.algorithm.reward_fn))
        with _user_input(reward_field, reward_value, RewardFunctionError, UnknownScorerError):
            self.reward = RewardManager.from_config(cfg.algorithm)
        steps_per_epoch = len(self.train_loader)
        self.total_steps = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * steps_per_epoch

    def _build_workers(self, restart: int = 0) -> None:

        plan, trainer = self.plan, self.config.trainer
        res = plan.resolved
        policy = plan.device_policy
        repo_root = str(Path(__file__).resolve().parents[2])
        if self.cluster is None:  # a restart keeps the run's Ray cluster
            self.cluster = init_ray(trainer.ray_address, num_cpus=policy.ray_cluster_cpus(res.total_ranks),
                                    pythonpath=[repo_root], preload_modules=("torch",))
        colocated = (1 + int(res.critic_enabled) + int(self.config.reward_model.enable)
                     + int(self.config.algorithm.distillation.enable and not res.teacher_world))
        self.pool = ResourcePool("trainer", nnodes=trainer.nnodes,
                                 workers_per_node=trainer.n_gpus_per_node, device_policy=policy,
                                 cpus_per_worker=policy.ray_cpus_per_worker, max_colocated_groups=colocated)
        # a restart waits for the resources of a failed node to come back (a replacement joining)
        wait_s = trainer.restart_wait_s if restart else 300
        self.pool.start(timeout_s=wait_s)
        if res.disaggregated:
            self._build_disaggregated(restart, wait_s)
        else:
            self._build_hybrid_engine(restart)
        if res.critic_enabled:

            self.critic_group = self._worker_group(CriticWorker, self.pool, GroupName.CRITIC, (plan,), restart)
            self.critic_group.call_all(CriticWorker.init_model, self.total_steps)
            self.critic_group.learn_mesh()
        if self.config.reward_model.enable:

            self.rm_group = self._worker_group(RewardModelWorker, self.pool, GroupName.REWARD_MODEL, (plan,), restart)
            self.rm_group.call_all(RewardModelWorker.init_model)
            self.rm_group.learn_mesh()
        if self.config.algorithm.distillation.enable:
            teacher_pool = self.pool
            if res.teacher_world:  # teacher.mode=disaggregated: a pool of its own
                teacher = self.config.teacher
                self.teacher_pool = teacher_pool = ResourcePool(
                    "teacher", nnodes=teacher.nnodes, workers_per_node=teacher.n_gpus_per_node, device_policy=policy,
                    cpus_per_worker=policy.ray_cpus_per_worker, max_colocated_groups=1)
                self.teacher_pool.start(timeout_s=wait_s)
            self.teacher_group = self._worker_group(TeacherWorker, teacher_pool, GroupName.TEACHER, (plan,), restart)
            self.teacher_group.call_all(TeacherWorker.init_model)
            self.teacher_group.learn_mesh()
        if trainer.nnodes > 1 or res.disaggregated or res.teacher_world:
            groups = {id(g): g for g in (self.actor_group, self.rollout_group, self.critic_group, self.rm_group,
                                         self.teacher_group) if g is not None}
            for group in groups.values():
                self.write(group.placement_line())

    def _worker_group(self, worker_cls: type[Worker], pool: ResourcePool, role: str, worker_args: tuple[object, ...],
                      restart: int) -> WorkerGroup:
        """A group with the run's limits: every collective `trainer.nccl_timeout_s`, every worker call (a phase of
        a step) `trainer.step_timeout_s`, past which the call counts as hung and the group fails naming it."""
        trainer = self.config.trainer
        return WorkerGroup(worker_cls, pool, role=role, worker_args=worker_args,
                           process_group_timeout_s=trainer.nccl_timeout_s, call_timeout_s=trainer.step_timeout_s,
                           restart=restart)

    def _build_hybrid_engine(self, restart: int) -> None:
        """Colocated: actor, reference and vLLM in the same processes; the first proven sync."""
        plan = self.plan
        settings = HybridSettings(probe_tolerance=plan.resolved.probe_tolerance, pad_token_id=self.pad_token_id)
        self.actor_group = self._worker_group(HybridEngineWorker, self.pool, GroupName.ACTOR_ROLLOUT_REF,
                                              (plan, settings), restart)
        self.rollout_group = self.actor_group
        self._generate_method = HybridEngineWorker.generate_sequences
        setup = self.actor_group.call_all(HybridEngineWorker.setup, self.total_steps)
        self.actor_group.learn_mesh()
        self._learn_rollout_mesh(HybridEngineWorker.rollout_coords)
        if not all(s["placement_as_planned"] for s in setup):
            self.write("warning: vLLM's TP groups differ from the plan's; weight syncs move more than planned")
        infer_tp = plan.config.actor_rollout_ref.rollout.tensor_model_parallel_size
        self.write(f"hybrid engine up in {max(s['setup_s'] for s in setup):.1f} s: rollout replicas "
                   f"{self.rollout_mesh.dp_size} × infer_tp {infer_tp}, first sync probe gap "
                   f"{max(s['reshard/probe_max_abs_gap'] for s in setup):.2e}")

    def _build_disaggregated(self, restart: int, wait_s: float) -> None:
        """rollout.mode=disaggregated: the policy on the trainer pool, vLLM on a pool of its own, one
        group spanning both for the weight syncs; the first sync (version 0) proven like every other."""
        plan, arr = self.plan, self.config.actor_rollout_ref
        res, policy = plan.resolved, plan.device_policy
        self.rollout_pool = ResourcePool("rollout", nnodes=arr.rollout.nnodes,
                                         workers_per_node=arr.rollout.n_gpus_per_node, device_policy=policy,
                                         cpus_per_worker=policy.ray_cpus_per_worker, max_colocated_groups=1)
        self.rollout_pool.start(timeout_s=wait_s)
        started = time.perf_counter()
        self.actor_group = self._worker_group(DisaggregatedPolicyWorker, self.pool, GroupName.ACTOR_ROLLOUT_REF,
                                              (plan, self.pad_token_id), restart)
        self.rollout_group = self._worker_group(RolloutWorker, self.rollout_pool, GroupName.ROLLOUT,
                                                (plan, self.pad_token_id), restart)
        self._generate_method = RolloutWorker.generate_sequences
        # both pools build at once (megatron on one, vLLM on the other)
        wait_together([self.actor_group.submit_all(DisaggregatedPolicyWorker.setup, self.total_steps),
                       self.rollout_group.submit_all(RolloutWorker.setup)])
        self.actor_group.learn_mesh()
        self._learn_rollout_mesh(RolloutWorker.rollout_coords)
        host, port = self.actor_group.call_all(DisaggregatedPolicyWorker.open_weight_sync)[0]
        address = CrossGroupAddress(host, port, res.world_size, res.rollout_world)
        wait_together([self.actor_group.submit_all(DisaggregatedPolicyWorker.join_weight_sync, address),
                       self.rollout_group.submit_all(RolloutWorker.join_weight_sync, address)])
        first = self.sync_weights(version=0)
        self.write(f"disaggregated rollout up in {time.perf_counter() - started:.1f} s: trainer pool "
                   f"{res.world_size} ranks, rollout pool {res.rollout_world} ranks ({self.rollout_mesh.dp_size} "
                   f"replicas × infer_tp {arr.rollout.tensor_model_parallel_size}), first sync probe gap "
                   f"{first['reshard/probe_max_abs_gap']:.2e}")

    def _learn_rollout_mesh(self, coords_method: Any) -> None:
        coords = self.rollout_group.call_all(coords_method)
        replica_ids = sorted({c["replica"] for c in coords})
        self.rollout_mesh = RankMesh.from_coords(
            [MeshCoord(dp=replica_ids.index(c["replica"]), tp=c["tp"]) for c in coords])

    def sync_weights(self, version: int | None = None) -> dict[str, float]:
        """The actor's weights into every vLLM replica, proven (checksums + the probe on each replica);
        the sync's figures, the worst rank's each. `version`: the policy version being served after it."""
        version = self.global_step if version is None else version
        if not self.plan.resolved.disaggregated:
            return _sync_metrics(self.actor_group.call_all(HybridEngineWorker.sync_weights))
        sends, receives = wait_together([
            self.actor_group.submit_all(DisaggregatedPolicyWorker.send_weights, version),
            self.rollout_group.submit_all(RolloutWorker.receive_weights, version)])
        probe = sends[0]["probe"]
        gaps = [g for g in self.rollout_group.call_all(RolloutWorker.probe_gap, probe,
                                                       self.plan.resolved.probe_tolerance) if g is not None]
        metrics = _sync_metrics([s["metrics"] for s in sends] + list(receives))
        metrics.update({"reshard/probe_max_abs_gap": max(gaps), "reshard/probe_replicas": float(len(gaps)),
                        "reshard/version": float(version)})
        return metrics

    def _greedy_sampling(self) -> Any:
        """One greedy response per prompt (validation by default, ReMax's baseline)."""

        return validation_sampling(self.plan.resolved.response_length,
                                   stop_token_ids=tuple(self.config.actor_rollout_ref.rollout.stop_token_ids))

    def _sampling(self, validation: bool = False, step: int | None = None) -> RolloutSampling:

        rollout = self.config.actor_rollout_ref.rollout
        max_tokens = self.plan.resolved.response_length
        stops = tuple(rollout.stop_token_ids)
        if validation:
            vk = rollout.val_kwargs
            if not vk.do_sample or vk.temperature == 0:
                return self._greedy_sampling()
            return RolloutSampling(n=vk.n, temperature=vk.temperature, top_p=vk.top_p,
                                   top_k=vk.top_k if vk.top_k > 0 else None, max_tokens=max_tokens,
                                   stop_token_ids=stops)
        # A seed per step (not per engine call): a resumed run samples step k+1 exactly like the
        # uninterrupted one, whatever the engines' call counters say.
        step = self.global_step if step is None else step  # an async rollout draws ahead of the trainer
        step_seed = (self.config.trainer.seed * 1_000_003 + rollout.seed * 7919 + step) % (2**31)
        return RolloutSampling(n=rollout.n, temperature=rollout.temperature, top_p=rollout.top_p,
                               top_k=rollout.top_k if rollout.top_k > 0 else None, max_tokens=max_tokens,
                               stop_token_ids=stops, ignore_eos=rollout.ignore_eos, seed=step_seed)

    # ------------------------------------------------------------------------------ the rollout driver's source
    # (`async_rollout.RolloutSource`: what an asynchronous rollout reads of the trainer, from its own thread)
    def next_prompts(self) -> Batch:
        return next(self._prompts)

    def loader_state(self) -> dict[str, Any]:
        return self.train_loader.state_dict()

    def sampling_for_step(self, step: int) -> RolloutSampling:
        return self._sampling(step=step)

    # ------------------------------------------------------------------------------ phases
    @contextmanager
    def _phase(self, timer: PhaseTimer, name: Phase) -> Iterator[None]:
        """Time a phase and remember it, so a failure inside it is reported with its name."""
        self.phase = name
        with timer.phase(name):
            yield

    def generate(self, prompts: Batch, sampling: RolloutSampling) -> Batch:
        """Samples for every prompt, over the rollout replicas; rows prompt-major, n per prompt."""

        replicas = self.rollout_mesh.dp_size
        padded, pad = prompts.pad_to_multiple(replicas)
        if pad:  # padding rows repeat real prompts: give them their own uids, drop their samples after
            uids = np.array(padded["uid"], dtype=object)
            uids[len(prompts):] = [f"{PAD_UID_PREFIX}{i}" for i in range(pad)]
            padded["uid"] = uids
        padded["raw_prompt_ids"] = unpadded_prompt_ids(padded)
        per_replica = self.rollout_group.call_by_dp_outputs(self._generate_method, padded, sampling,
                                                            mesh=self.rollout_mesh)
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
        if self.rm_group is not None:
            scores = self.rm_group.call_by_dp(RewardModelWorker.compute_rm_score, batch,
                                              balance_mini_batches=self._balance(),
                                              keep_together=self._keep_together(Role.REWARD_MODEL))["rm_scores"]
            metrics["reward/rm_score_mean"] = float(scores.float().mean())
            token_scores = token_level_rewards(scores, batch["response_mask"])
        else:
            token_scores, output = self.reward.score_batch(batch, self.tokenizer)
            metrics.update({f"reward/{k.removeprefix('reward/')}": float(v) for k, v in output.metrics.items()})
            batch.meta["reward_output"] = output  # dynamic sampling's metrics over all rounds read it
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
        with self._phase(timer, Phase.GEN):
            batch = self.generate(prompts, self._sampling())
        metrics.update(batch.meta.pop("metrics", {}) or {})
        with self._phase(timer, Phase.REWARD):
            metrics.update(self.score(batch))
        if self.config.algorithm.adv_estimator in GREEDY_BASELINE_ADV_ESTIMATORS:
            metrics.update(self._greedy_baseline(prompts, batch, timer))
        return batch

    def _greedy_baseline(self, prompts: Batch, batch: Batch, timer: PhaseTimer) -> dict[str, float]:
        """ReMax: one greedy response per prompt, scored by the same reward as the samples (scorer or
        reward model, overlong penalty); its score is the baseline of every sample of that prompt."""
        with self._phase(timer, Phase.GEN_BASELINE):
            greedy = self.generate(prompts, self._greedy_sampling())
        with self._phase(timer, Phase.REWARD_BASELINE):
            self.score(greedy)
        greedy_scores = greedy["token_level_scores"].sum(-1)
        batch["baseline_scores"] = baseline_per_row(batch["uid"], greedy["uid"], greedy_scores)
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
        return self.train_on(batch, timer, metrics, self.sync_weights)

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
        plan, cfg = self.plan, self.config
        if plan.resolved.free_cache_engine:
            self.phase = Phase.RELEASE_ROLLOUT_MEMORY
            self.actor_group.call_all(HybridEngineWorker.release_rollout_memory)
        batch.meta["temperature"] = cfg.actor_rollout_ref.rollout.temperature
        if plan.resolved.old_log_prob_pass:  # else the update's forward is the old policy (on-policy)
            with self._phase(timer, Phase.OLD_LOG_PROB):
                old = self.actor_group.call_by_dp(PolicyWorker.compute_log_prob, batch, with_entropy=True,
                                                  balance_mini_batches=self._balance(),
                                                  keep_together=self._keep_together(Role.ACTOR))
                batch["old_log_probs"] = old["old_log_probs"]
                metrics["perf/padding_ratio_old_log_prob"] = float(old.meta.get("padding_ratio", 0.0))
                metrics["perf/shared_prefix_ratio_old_log_prob"] = float(old.meta.get("shared_prefix_ratio", 0.0))
                if "router_replay_mismatch" in old.meta:  # actor.router_replay: rollout
                    metrics["actor/router_replay_mismatch_old_log_prob"] = float(old.meta["router_replay_mismatch"])
                mask = batch["response_mask"].float()
                if "old_log_probs_truncated" in old.tensors:  # rollout_correction.match_truncation
                    batch["old_log_probs_truncated"] = old["old_log_probs_truncated"]
                    # sampled tokens the trainer's own top-k/top-p drops (boundary disagreements)
                    metrics["rollout_correction/truncation_outside_fraction"] = float(
                        (old["old_log_probs_outside"].float() * mask).sum() / mask.sum().clamp(min=1))
                metrics["actor/entropy"] = float(masked_mean(old["entropys"], mask))
                # how far the rollout's own log-probs are from the trainer's: a numerics/sync health check
                metrics.update(rollout_log_prob_gap(old["old_log_probs"], batch["rollout_log_probs"], mask))
        if plan.resolved.ref_enabled:
            with self._phase(timer, Phase.REF):
                ref = self.actor_group.call_by_dp(PolicyWorker.compute_ref_log_prob, batch,
                                                  balance_mini_batches=self._balance(),
                                                  keep_together=self._keep_together(Role.REF))
                batch["ref_log_probs"] = ref["ref_log_probs"]
                metrics["perf/padding_ratio_ref_log_prob"] = float(ref.meta.get("padding_ratio", 0.0))
                metrics["perf/shared_prefix_ratio_ref_log_prob"] = float(ref.meta.get("shared_prefix_ratio", 0.0))
        if self.teacher_group is not None:
            with self._phase(timer, Phase.TEACHER):
                teacher = self.teacher_group.call_by_dp(TeacherWorker.compute_teacher_log_prob, batch,
                                                        balance_mini_batches=self._balance(),
                                                        keep_together=self._keep_together(Role.TEACHER))
                batch["teacher_log_probs"] = teacher["teacher_log_probs"]
                for key in TEACHER_TOP_K_KEYS:  # top_k_forward_kl: the teacher's distribution, for the update
                    if key in teacher.tensors:
                        batch[key] = teacher[key]
                metrics["perf/padding_ratio_teacher_log_prob"] = float(teacher.meta.get("padding_ratio", 0.0))
        if self.critic_group is not None:
            with self._phase(timer, Phase.VALUES):
                batch["values"] = self.critic_group.call_by_dp(
                    CriticWorker.compute_values, batch, balance_mini_batches=self._balance(),
                    keep_together=self._keep_together(Role.CRITIC))["values"]
        with self._phase(timer, Phase.ADV):
            if cfg.algorithm.use_kl_in_reward:
                metrics.update(apply_kl_in_reward(batch, self.kl_controller, cfg.algorithm.kl_penalty))
            else:
                batch["token_level_rewards"] = batch["token_level_scores"]
            distillation = cfg.algorithm.distillation
            if not distillation.enable or distillation.task_reward:
                compute_batch_advantages(batch, AdvantageSettings(
                    cfg.algorithm.adv_estimator, cfg.algorithm.gamma, cfg.algorithm.lam,
                    cfg.algorithm.norm_adv_by_std_in_grpo))
            if distillation.enable:
                # the sampled-token reverse KL: the advantage (sampled_reverse_kl), else a metric beside the update's
                # top-k loss term
                metrics.update(add_distillation_advantages(
                    batch, distillation.kl_coef, with_task_reward=distillation.task_reward,
                    in_advantage=not plan.resolved.distillation_top_k))
        if self.critic_group is not None:
            with self._phase(timer, Phase.UPDATE_CRITIC):
                outs = self.critic_group.call_by_dp_outputs(
                    CriticWorker.update_critic, batch,
                    balance_mini_batches=self._balance(batch, Role.CRITIC),
                    keep_together=self._keep_together(Role.CRITIC))
                metrics.update(_mean_dicts([o.as_dict() if o is not None else None for o in outs]))
        with self._phase(timer, Phase.UPDATE_ACTOR):
            balance = self._balance(batch, Role.ACTOR)
            outs = self.actor_group.call_by_dp_outputs(PolicyWorker.update_actor, batch,
                                                       balance_mini_batches=balance,
                                                       keep_together=self._keep_together(Role.ACTOR))
            metrics.update(_mean_dicts(outs))
            metrics["perf/dp_token_imbalance"] = self._dp_imbalance(Role.ACTOR, batch, balance)
        with self._phase(timer, Phase.SYNC):
            metrics.update(sync())
        metrics.update(response_metrics(batch))
        if cfg.trainer.rollout_data_dir:
            self._dump_rollout(batch, Path(cfg.trainer.rollout_data_dir))
        metrics.update(timer.metrics())
        tokens = int(batch["attention_mask"].sum())
        metrics.update(throughput_metrics(tokens, len(batch), metrics["timing_s/step"], plan.resolved.total_ranks))
        return metrics

    def _update_mini_batches(self, role: str, batch: Batch) -> int:
        """The global mini-batches of one epoch of `role`'s update on `batch` (each rank cuts its chunk
        into this many)."""
        per_rank = self.plan.update(role).sequences_per_rank_per_mini_batch
        return max(1, len(batch) // (per_rank * self.plan.layout(role).mesh.dp))

    def _balance(self, batch: Batch | None = None, update_role: str | None = None) -> int | None:
        """`balance_mini_batches` for a DP call (None: the plain split, `trainer.balance_batch` off). A
        forward pass balances the whole batch; `update_role`'s update each of its mini-batches."""
        if not self.config.trainer.balance_batch:
            return None
        return 1 if update_role is None else self._update_mini_batches(update_role, batch)

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
        import json

        out_dir.mkdir(parents=True, exist_ok=True)
        prompt_width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
        response_mask = batch["response_mask"].bool()
        prompt_mask = batch["attention_mask"][:, :prompt_width].bool()
        # every token after the prompt: a multi-turn conversation's observations too (not trained)
        attended = batch["attention_mask"][:, prompt_width:].bool()
        per_sequence = {key: (batch[key] * response_mask).sum(-1).tolist()
                        for key in ("token_level_scores", "token_level_rewards") if key in batch}
        lines = []
        for row in range(len(batch)):
            response_ids = batch["responses"][row][attended[row]].tolist()
            trained = response_mask[row][attended[row]]
            record = {
                "step": self.global_step, "uid": batch["uid"][row],
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
            lines.append(json.dumps(record, default=_json_default))
        (out_dir / f"step_{self.global_step}.jsonl").write_text("\n".join(lines) + "\n")

    def validate(self) -> dict[str, float]:
        if self.val_loader is None:
            return {}
        if self.driver is not None:  # the rollout pool runs ahead: validate while it is parked
            with self.driver.hold():
                return self._validate()
        return self._validate()

    def _validate(self) -> dict[str, float]:
        scores: list[float] = []
        turn_parts: list[dict[str, float]] = []  # multi-turn: how the validation conversations went
        samples: list[int] = []
        self.phase = Phase.VALIDATE
        shown: list[dict[str, Any]] = []  # trainer.log_val_generations: the first samples, as scored
        for prompts in self.val_loader:
            batch = self.generate(prompts, self._sampling(validation=True))
            _, output = self.reward.score_batch(batch, self.tokenizer)
            shown.extend(self._generations(batch, output, self.config.trainer.log_val_generations - len(shown)))
            scores.extend(output.scores)
            generated = batch.meta.get("metrics") or {}
            turn_parts.append({k: v for k, v in generated.items()
                               if k.startswith("multi_turn/") and k.endswith("_mean")})
            samples.append(len(batch))
        metrics = {"val/score/mean": float(np.mean(scores)) if scores else math.nan}
        if shown:
            with (self.run_dir / VAL_GENERATIONS).open("a", encoding="utf-8") as out:  # one JSON line per sample
                out.writelines(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in shown)
        if any(turn_parts):
            merged = merge_part_metrics(turn_parts, samples)
            metrics.update({f"val/{k}": v for k, v in merged.items()})
        return metrics

    def _generations(self, batch: Batch, output: Any, count: int) -> list[dict[str, Any]]:
        """Up to `count` of a validation batch's samples as rows of val_generations.jsonl."""
        rows = []
        for i in range(min(max(count, 0), len(output.responses))):
            prompt = batch.non_tensors["raw_prompt"][i] if "raw_prompt" in batch.non_tensors else None
            rows.append({"step": self.global_step, "prompt": prompt, "response": output.responses[i],
                         "ground_truth": batch["ground_truth"][i], "score": output.scores[i]})
        return rows

    # ------------------------------------------------------------------------------ checkpoints
    def save(self) -> Path:

        self.phase = Phase.SAVE_CHECKPOINT
        partial = self.checkpoints.begin(self.global_step)
        try:
            self.actor_group.call_all(PolicyWorker.save_checkpoint, str(partial))
            if self.config.trainer.export_hf_on_save:
                self.actor_group.call_all(PolicyWorker.export_hf, str(partial / "actor_hf"))
            if self.critic_group is not None:
                self.critic_group.call_all(CriticWorker.save_checkpoint, str(partial))
            # an async rollout has drawn prompts the trainer has not trained on yet: resume before them
            loader = self.driver.loader_state() if self.driver is not None else self.train_loader.state_dict()
            state = {"dataloader": loader, "kl_coef": float(self.kl_controller.value)}
            return self.checkpoints.commit(partial, self.global_step, state)
        except BaseException:
            self.checkpoints.abort(partial)
            raise

    def resume(self, path: Path) -> None:
        """Restore workers, data order and KL coefficient from a complete checkpoint."""

        self.phase = Phase.RESUME
        state = self.checkpoints.read_state(path)
        if self.plan.resolved.disaggregated:  # restore the trainer pool, then serve its weights
            self.actor_group.call_all(DisaggregatedPolicyWorker.load_checkpoint, str(path))
            self.sync_weights(version=int(state["global_step"]))
        else:  # the hybrid engine restores the actor and syncs vLLM itself
            self.actor_group.call_all(HybridEngineWorker.load_checkpoint, str(path))
        if self.critic_group is not None:
            self.critic_group.call_all(CriticWorker.load_checkpoint, str(path))
        self.train_loader.load_state_dict(state["dataloader"])
        self.kl_controller.value = state.get("kl_coef", self.kl_controller.value)
        self.global_step = int(state["global_step"])
        self.write(f"resumed from {path} at step {self.global_step}")

    # ------------------------------------------------------------------------------ the loop
    def fit(self) -> RunResult:
        """Run the job to `total_steps`. A worker failure stops it (`TrainingFailure`), or, with
        `trainer.max_restarts`, restarts the workers in place from the last checkpoint this run wrote or
        resumed from (step 0 before any) and goes on, up to that many times."""
        from tqdm import tqdm

        cfg = self.config
        started = time.perf_counter()
        self._build_data()
        self.kl_controller = kl_controller_from_config(cfg.algorithm.kl_ctrl)
        self._fresh_loader_state = self.train_loader.state_dict()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoints.remove_partials()
        try:  # a bad trainer state is refused before Ray or any worker starts
            resume_from = self.checkpoints.resolve_resume(cfg.trainer.resume_mode)
            resume_step = int(self.checkpoints.read_state(resume_from)["global_step"]) if resume_from else 0
        except CheckpointError as error:
            raise TrainingFailure(0, Phase.RESUME, str(error)) from error
        self.last_checkpoint = resume_from  # what a restart resumes from: this run's newest sealed checkpoint
        tracker = Tracker.create(cfg.trainer.logger, self.run_dir, project=cfg.trainer.project_name,
                                 experiment=cfg.trainer.experiment_name, config=self.plan.to_dict()["config"],
                                 write=tqdm.write if self.progress else self.write, resume_step=resume_step)
        failures: list[TrainingFailure] = []
        try:
            while True:
                try:
                    self._run_steps(tracker, restart=len(failures))
                    break
                except ResourcePoolError as error:
                    if not failures:
                        raise
                    failures.append(TrainingFailure(self.global_step, Phase.SETUP,
                                                    f"restart {len(failures)} found no resources: {error}"))
                    raise _final_failure(failures, cfg.trainer.max_restarts) from error
                except WorkerGroupError as error:
                    # The group is already torn down (fail-fast gather); name where in the step it happened.
                    detected_at = time.time()
                    failure = TrainingFailure(self.global_step, self.phase, str(error))
                    failures.append(failure)
                    if len(failures) > cfg.trainer.max_restarts:
                        raise _final_failure(failures, cfg.trainer.max_restarts) from error
                    self._restart_in_place(tracker, failure, error, len(failures), detected_at)
        finally:
            tracker.close()
            self.shutdown()
        history = tracker.history
        summary = render_summary(history, f"{cfg.trainer.project_name}/{cfg.trainer.experiment_name}")
        if failures:
            summary += f"\n{'restarts':>16}: " + "; ".join(
                f"step {f.step} ({f.phase}): {f.cause.splitlines()[0]}" for f in failures)
        step_times = [h["timing_s/step"] for h in history if "timing_s/step" in h]
        if step_times:
            cost = failure_cost_lines(cfg.trainer.save_freq, cfg.trainer.max_restarts, float(np.median(step_times)))
            summary += f"\n{'failure cost':>16}: {cost[0]}"
        ratios = {key: float(np.median([h[key] for h in history if key in h]))
                  for key in dict.fromkeys(k for h in history for k in h if k.startswith("time_vs_plan/"))}
        if ratios:
            summary += f"\n{'time vs plan':>16}: " + ", ".join(
                f"{key.removeprefix('time_vs_plan/')} x{value:.2f}" for key, value in ratios.items()) + \
                f" (median measured / predicted on {self.predicted_step.hardware})"
        summary += f"\n{'wall time':>16}: {time.perf_counter() - started:.1f} s; run dir {self.run_dir}"
        if history:
            plot = plot_run(history, self.run_dir / "run.png")
            summary += f"\n{'plot':>16}: {plot}"
        return RunResult(self.global_step, history, self.run_dir, summary)

    def _run_steps(self, tracker: Tracker, restart: int = 0) -> None:
        """Start the workers (the `restart`-th time), resume from `last_checkpoint`, and train to the end."""
        from tqdm import tqdm

        cfg = self.config
        guard = NonFiniteGuard(cfg.trainer.max_consecutive_nonfinite_steps)
        self.phase = Phase.SETUP
        self._build_workers(restart)
        if self.last_checkpoint is not None:
            self.resume(self.last_checkpoint)
        if cfg.trainer.val_before_train and self.global_step == 0:
            tracker.log(0, self.validate())
        bar = tqdm(total=self.total_steps, initial=self.global_step, desc="training", unit="step",
                   disable=not self.progress)
        self._prompts = self._prompt_stream()
        if self.plan.resolved.async_mode != "sync":  # the rollout pool runs ahead in a thread
            self.driver = RolloutDriver(self, DriverSettings.of(self.plan))
            for group in (self.actor_group, self.critic_group, self.rm_group, self.teacher_group):
                if group is not None:
                    group.watchdog = self.driver.raise_if_failed
            self.driver.start()
        try:
            self._train_loop(tracker, guard, bar)
        finally:
            if self.driver is not None:
                self.driver.stop()
                self._stopped_driver, self.driver = self.driver, None

    def _train_loop(self, tracker: Tracker, guard: NonFiniteGuard, bar: Any) -> None:
        cfg = self.config
        while self.global_step < self.total_steps:
            self.global_step += 1
            metrics = self.step(self.next_prompts()) if self.driver is None else self._async_step()
            if self.predicted_step is not None:  # trainer.hardware: where the run departs from its plan's time
                metrics.update(time_vs_plan(self.predicted_step, metrics))
            metrics.update(guard.observe(metrics))
            metrics["training/global_step"] = self.global_step
            metrics["training/epoch"] = self.train_loader.epoch
            last = self.global_step >= self.total_steps
            # the last step validates too, as it saves: a run ends with its final score measured
            if cfg.trainer.test_freq > 0 and (self.global_step % cfg.trainer.test_freq == 0 or last):
                metrics.update(self.validate())
            tracker.log(self.global_step, metrics)
            bar.update(1)
            if guard.exhausted:
                raise TrainingFailure(self.global_step, Phase.UPDATE_ACTOR, (
                    f"{guard.consecutive} steps in a row skipped their optimizer step for a non-finite "
                    "loss or gradient (trainer.max_consecutive_nonfinite_steps="
                    f"{guard.limit}); the weights are those of the last finite step"))
            if cfg.trainer.save_freq > 0 and (self.global_step % cfg.trainer.save_freq == 0 or last):
                self.last_checkpoint = self.save()
        bar.close()

    def _async_step(self) -> dict[str, float]:
        """One training step on the rollout pool's next batch (generated ahead, one or more versions old),
        then the sync of the new weights with the driver held at a boundary."""
        timer = PhaseTimer()
        with self._phase(timer, Phase.WAIT_ROLLOUT):
            batch, metrics = self.driver.next_batch(self.global_step)

        def sync() -> dict[str, float]:
            with self.driver.hold(version=self.global_step):
                return self.sync_weights(version=self.global_step)

        return self.train_on(batch, timer, metrics, sync)

    def _restart_in_place(self, tracker: Tracker, failure: TrainingFailure, error: WorkerGroupError,
                          restart: int, detected_at: float) -> None:
        """Tear every group down, go back to `last_checkpoint` (or step 0), and log why (and when the
        failure was detected: `detected_at`, wall-clock seconds)."""
        self._shutdown_workers()
        self._await_stopped_driver(failure.step)
        self.checkpoints.remove_partials()  # a save the failure interrupted
        if self.last_checkpoint is not None:
            resume_step = int(self.checkpoints.read_state(self.last_checkpoint)["global_step"])
        else:  # no checkpoint yet: step 0, with the data order and KL state of a fresh start
            resume_step = 0
            self.global_step = 0
            self.train_loader.load_state_dict(self._fresh_loader_state)
            self.kl_controller = kl_controller_from_config(self.config.algorithm.kl_ctrl)
        tracker.rewind(resume_step)
        where = f"from {self.last_checkpoint}" if self.last_checkpoint is not None else "from the start"
        # the headline on one line (what failed, where it goes on from), the workers' reports after it
        headline, _, details = str(failure).partition("\n")
        self.write(f"restart {restart}/{self.config.trainer.max_restarts} in place: {headline}; "
                   f"resuming {where} at step {resume_step}" + (f"\n{details}" if details else ""))
        tracker.event(failure.step, {
            "event": "restart", "restart": restart, "max_restarts": self.config.trainer.max_restarts,
            "phase": str(failure.phase), "role": error.role, "rank": error.rank,
            "cause": str(error).splitlines()[0], "detected_at": detected_at, "resume_step": resume_step,
            "resume_from": str(self.last_checkpoint) if self.last_checkpoint is not None else None,
        })

    def _await_stopped_driver(self, step: int) -> None:
        """The failed attempt's rollout thread must be gone before new groups start: it reads the trainer's
        groups and prompt stream, so a thread still running would call into the new workers or take a prompt
        batch of the resumed run. The teardown just ended any call it had in flight."""
        driver, self._stopped_driver = self._stopped_driver, None
        if driver is not None and not driver.ended(STOPPED_DRIVER_WAIT_S):
            raise TrainingFailure(step, Phase.SETUP, (
                f"the rollout driver of the failed attempt was still running {STOPPED_DRIVER_WAIT_S:.0f} s after "
                "its workers were torn down; restarting would let it call into the new workers"))

    def _prompt_stream(self):
        """Prompt batches across epochs (the loader reshuffles per epoch and resumes mid-epoch)."""
        while True:
            yield from self.train_loader

    def _shutdown_workers(self) -> None:
        """Kill every group's actors and give the pools' resources back (the Ray cluster stays)."""
        for group in (self.teacher_group, self.rm_group, self.critic_group, self.rollout_group, self.actor_group):
            if group is not None:
                group.shutdown()
        for pool in (self.pool, self.rollout_pool, self.teacher_pool):
            if pool is not None:
                pool.shutdown()
        self.pool = self.actor_group = self.critic_group = self.rm_group = self.teacher_group = None
        self.rollout_pool = self.rollout_group = self.teacher_pool = None

    def shutdown(self) -> None:
        self._shutdown_workers()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None


def _final_failure(failures: list[TrainingFailure], max_restarts: int) -> TrainingFailure:
    """The failure that stops the run; with restarts, it names every failure before it too."""
    last = failures[-1]
    if len(failures) == 1:
        return last
    earlier = "; ".join(f"{i}) step {f.step}, phase {f.phase}: {f.cause.splitlines()[0]}"
                        for i, f in enumerate(failures[:-1], 1))
    return TrainingFailure(last.step, last.phase, (
        f"{last.cause}\n(the run's failure {len(failures)}, with trainer.max_restarts={max_restarts}; it had "
        f"restarted in place after: {earlier})"))


def _json_default(value: Any) -> Any:
    """numpy scalars and other metadata values in a rollout dump line."""
    return value.item() if hasattr(value, "item") else str(value)


def _mean_dicts(items: list[dict[str, Any] | None]) -> dict[str, float]:
    """Mean over DP ranks of each numeric metric (ranks report equal values for global ones)."""
    numeric: dict[str, list[float]] = {}
    for item in items:
        for key, value in (item or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                numeric.setdefault(key, []).append(float(value))
    return {key: float(np.mean(values)) for key, values in numeric.items()}


def _sync_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Per-sync figures over ranks: the worst rank for bytes, time, memory and the probe gap."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for r in per_rank for k in r):  # ranks of two pools report different keys
        values = [r[key] for r in per_rank if isinstance(r.get(key), (int, float))]
        if values:
            out[key] = float(max(values))
    return out
