"""The run's worker groups on their resource pools, for either placement: built (and rebuilt in place after a
failure), the weight sync into the rollout, torn down.

Colocated (verl's hybrid engine): one group holds the actor, the reference and vLLM in the same processes.
Disaggregated: the policy on the trainer pool, vLLM on a pool of its own, one cross-pool group for the syncs. The
critic, the reward model and the teacher (on the trainer pool, or the teacher on its own) are groups of their own in
both.
"""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any, TypeVar

from hybridrl.config.plan import Plan
from hybridrl.controller.base_worker import Worker
from hybridrl.controller.cluster import init_ray
from hybridrl.controller.dispatch import MeshCoord, RankMesh
from hybridrl.controller.resource_pool import ResourcePool
from hybridrl.controller.worker_group import WorkerGroup, wait_together
from hybridrl.names import GroupName
from hybridrl.parallel.cross_group import CrossGroupAddress
from hybridrl.workers.colocated import ColocatedPolicyWorker, ColocatedSettings
from hybridrl.workers.critic import CriticWorker
from hybridrl.workers.frozen_roles import RewardModelWorker, TeacherWorker
from hybridrl.workers.policy import DisaggregatedPolicyWorker
from hybridrl.workers.rollout_worker import RolloutWorker

Part = TypeVar("Part")


class WorkerTopology:
    """The groups of one run: `actor` (the policy, with vLLM when colocated), `rollout` (vLLM's: the actor's group
    when colocated), `critic`, `reward_model`, `teacher` (None when the job has none), and the Ray cluster and pools
    under them. The cluster outlives a restart; the pools and groups do not."""

    def __init__(self, plan: Plan, write: Any = print) -> None:
        self.plan = plan
        self.config = plan.config
        self.write = write
        self.cluster: Any = None
        self.pool: ResourcePool | None = None
        self.rollout_pool: ResourcePool | None = None  # disaggregated: vLLM's own
        self.teacher_pool: ResourcePool | None = None  # teacher.mode=disaggregated
        self.actor: WorkerGroup | None = None
        self.rollout: WorkerGroup | None = None
        self.critic: WorkerGroup | None = None
        self.reward_model: WorkerGroup | None = None
        self.teacher: WorkerGroup | None = None
        self.learned_rollout_mesh: RankMesh | None = None  # the rollout's replicas (DP) x their TP ranks
        self.generate_method: Any = None  # the rollout group's worker method that generates

    @property
    def rollout_mesh(self) -> RankMesh:
        """The rollout's replicas (DP) x their TP ranks, as the rollout's workers reported them at set-up."""
        return _built(self.learned_rollout_mesh, "the rollout mesh")

    @property
    def actor_group(self) -> WorkerGroup:
        """The policy's group (actor, reference and, colocated, vLLM), once built."""
        return _built(self.actor, "the actor_rollout_ref group")

    @property
    def rollout_group(self) -> WorkerGroup:
        """The group that generates (the actor's when colocated), once built."""
        return _built(self.rollout, "the rollout group")

    @property
    def groups(self) -> tuple[WorkerGroup, ...]:
        """Every group, each once (colocated, the rollout is the actor's group)."""
        found = (self.actor, self.rollout, self.critic, self.reward_model, self.teacher)
        return tuple({id(g): g for g in found if g is not None}.values())

    def build(self, restart: int, total_steps: int, pad_token_id: int) -> None:
        """Start the pools and every group (the `restart`-th time: a restart waits `trainer.restart_wait_s` for a
        failed node's resources), each with its model loaded and the rollout's first proven sync."""
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
            self._build_disaggregated(restart, wait_s, total_steps, pad_token_id)
        else:
            self._build_colocated(restart, total_steps, pad_token_id)
        if res.critic_enabled:
            self.critic = self._group(CriticWorker, self.pool, GroupName.CRITIC, (plan,), restart)
            self.critic.call_all(CriticWorker.init_model, total_steps)
            self.critic.learn_mesh()
        if self.config.reward_model.enable:
            self.reward_model = self._group(RewardModelWorker, self.pool, GroupName.REWARD_MODEL, (plan,), restart)
            self.reward_model.call_all(RewardModelWorker.init_model)
            self.reward_model.learn_mesh()
        if self.config.algorithm.distillation.enable:
            teacher_pool = self.pool
            if res.teacher_world:  # teacher.mode=disaggregated: a pool of its own
                teacher = self.config.teacher
                self.teacher_pool = teacher_pool = ResourcePool(
                    "teacher", nnodes=_pool_size(teacher.nnodes, "teacher.nnodes"),
                    workers_per_node=_pool_size(teacher.n_gpus_per_node, "teacher.n_gpus_per_node"),
                    device_policy=policy,
                    cpus_per_worker=policy.ray_cpus_per_worker, max_colocated_groups=1)
                self.teacher_pool.start(timeout_s=wait_s)
            self.teacher = self._group(TeacherWorker, teacher_pool, GroupName.TEACHER, (plan,), restart)
            self.teacher.call_all(TeacherWorker.init_model)
            self.teacher.learn_mesh()
        if trainer.nnodes > 1 or res.disaggregated or res.teacher_world:
            for group in self.groups:
                self.write(group.placement_line())

    def _group(self, worker_cls: type[Worker], pool: ResourcePool, name: GroupName, worker_args: tuple[object, ...],
               restart: int) -> WorkerGroup:
        """A group with the run's limits: every collective `trainer.nccl_timeout_s`, every worker call (a phase of
        a step) `trainer.step_timeout_s`, past which the call counts as hung and the group fails naming it."""
        trainer = self.config.trainer
        return WorkerGroup(worker_cls, pool, name=name, worker_args=worker_args,
                           process_group_timeout_s=trainer.nccl_timeout_s, call_timeout_s=trainer.step_timeout_s,
                           restart=restart)

    def _build_colocated(self, restart: int, total_steps: int, pad_token_id: int) -> None:
        """Colocated: actor, reference and vLLM in the same processes; the first proven sync."""
        plan = self.plan
        settings = ColocatedSettings(probe_tolerance=plan.resolved.probe_tolerance, pad_token_id=pad_token_id)
        self.actor = self._group(ColocatedPolicyWorker, _built(self.pool, "the training pool"),
                                 GroupName.ACTOR_ROLLOUT_REF,
                                              (plan, settings), restart)
        self.rollout = self.actor
        self.generate_method = ColocatedPolicyWorker.generate_sequences
        setup = self.actor.call_all(ColocatedPolicyWorker.setup, total_steps)
        self.actor.learn_mesh()
        rollout_mesh = self._learn_rollout_mesh(ColocatedPolicyWorker.rollout_coords)
        if not all(s["placement_as_planned"] for s in setup):
            self.write("warning: vLLM's TP groups differ from the plan's; weight syncs move more than planned")
        infer_tp = plan.config.actor_rollout_ref.rollout.tensor_model_parallel_size
        self.write(f"colocated policy up in {max(s['setup_s'] for s in setup):.1f} s: rollout replicas "
                   f"{rollout_mesh.dp_size} × infer_tp {infer_tp}, first sync probe gap "
                   f"{max(s['reshard/probe_max_abs_gap'] for s in setup):.2e}")

    def _build_disaggregated(self, restart: int, wait_s: float, total_steps: int, pad_token_id: int) -> None:
        """rollout.mode=disaggregated: the policy on the trainer pool, vLLM on a pool of its own, one
        group spanning both for the weight syncs; the first sync (version 0) proven like every other."""
        plan, arr = self.plan, self.config.actor_rollout_ref
        res, policy = plan.resolved, plan.device_policy
        self.rollout_pool = ResourcePool(
            "rollout", nnodes=_pool_size(arr.rollout.nnodes, "actor_rollout_ref.rollout.nnodes"),
            workers_per_node=_pool_size(arr.rollout.n_gpus_per_node, "actor_rollout_ref.rollout.n_gpus_per_node"),
            device_policy=policy, cpus_per_worker=policy.ray_cpus_per_worker, max_colocated_groups=1)
        self.rollout_pool.start(timeout_s=wait_s)
        started = time.perf_counter()
        self.actor = self._group(DisaggregatedPolicyWorker, _built(self.pool, "the training pool"),
                                 GroupName.ACTOR_ROLLOUT_REF,
                                              (plan, pad_token_id), restart)
        self.rollout = self._group(RolloutWorker, self.rollout_pool, GroupName.ROLLOUT,
                                                (plan, pad_token_id), restart)
        self.generate_method = RolloutWorker.generate_sequences
        # the two pools run at once (the trainer updates while vLLM generates): where they share a machine they share
        # its cores, and each rank's torch threads count both pools' ranks there
        sharing: Counter[str] = Counter()
        for pool in (self.pool, self.rollout_pool):
            sharing.update(pool.ranks_by_machine() if pool is not None else {})
        shared_by = max(self.actor.call_all(Worker.share_cores, dict(sharing))
                        + self.rollout.call_all(Worker.share_cores, dict(sharing)))
        # both pools build at once (megatron on one, vLLM on the other)
        wait_together([self.actor.submit_all(DisaggregatedPolicyWorker.setup, total_steps),
                       self.rollout.submit_all(RolloutWorker.setup)])
        self.actor.learn_mesh()
        rollout_mesh = self._learn_rollout_mesh(RolloutWorker.rollout_coords)
        host, port = self.actor.call_all(DisaggregatedPolicyWorker.open_weight_sync)[0]
        address = CrossGroupAddress(host, port, res.world_size, res.rollout_world)
        wait_together([self.actor.submit_all(DisaggregatedPolicyWorker.join_weight_sync, address),
                       self.rollout.submit_all(RolloutWorker.join_weight_sync, address)])
        first = self.sync_weights(version=0)
        self.write(f"disaggregated rollout up in {time.perf_counter() - started:.1f} s: trainer pool "
                   f"{res.world_size} ranks, rollout pool {res.rollout_world} ranks ({rollout_mesh.dp_size} "
                   f"replicas × infer_tp {arr.rollout.tensor_model_parallel_size}), up to {shared_by} ranks "
                   f"sharing a machine's cores, first sync probe gap {first['reshard/probe_max_abs_gap']:.2e}")

    def _learn_rollout_mesh(self, coords_method: Any) -> RankMesh:
        coords = self.rollout_group.call_all(coords_method)
        replica_ids = sorted({c["replica"] for c in coords})
        self.learned_rollout_mesh = RankMesh.from_coords(
            [MeshCoord(dp=replica_ids.index(c["replica"]), tp=c["tp"]) for c in coords])
        return self.learned_rollout_mesh

    def sync_weights(self, version: int) -> dict[str, float]:
        """The actor's weights into every vLLM replica, proven (checksums + the probe on each replica);
        the sync's figures, the worst rank's each. `version`: the policy version being served after it."""
        if not self.plan.resolved.disaggregated:
            return _sync_metrics(self.actor_group.call_all(ColocatedPolicyWorker.sync_weights))
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

    def shutdown_workers(self) -> None:
        """Kill every group's actors and give the pools' resources back (the Ray cluster stays)."""
        for group in (self.teacher, self.reward_model, self.critic, self.rollout, self.actor):
            if group is not None:
                group.shutdown()
        for pool in (self.pool, self.rollout_pool, self.teacher_pool):
            if pool is not None:
                pool.shutdown()
        self.pool = self.actor = self.critic = self.reward_model = self.teacher = None
        self.rollout_pool = self.rollout = self.teacher_pool = None

    def shutdown(self) -> None:
        self.shutdown_workers()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None


def _sync_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Per-sync figures over ranks: the worst rank for bytes, time, memory and the probe gap."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for r in per_rank for k in r):  # ranks of two pools report different keys
        values = [r[key] for r in per_rank if isinstance(r.get(key), (int, float))]
        if values:
            out[key] = float(max(values))
    return out


def _built(part: Part | None, what: str) -> Part:
    if part is None:
        raise RuntimeError(f"{what} is not built (WorkerTopology.build first, or the job has none)")
    return part


def _pool_size(value: int | None, field: str) -> int:
    """A pool's nnodes / n_gpus_per_node as the config gives it (the validation refuses a pool without them)."""
    if value is None:
        raise ValueError(f"{field} is not set: a pool of its own needs it")
    return value
