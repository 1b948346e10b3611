"""Ray-facing role workers: what the trainer drives through `controller.WorkerGroup`.

Each class is a `controller.base_worker.Worker`: constructed with its `RankContext` and the
`Plan` (nothing touches torch.distributed there), joined into the group's process group by the
`WorkerGroup`, then set up by the trainer calling `init_model()` on every rank. After that,
`mesh_coords()` reports the rank's (dp, tp, pp, cp) for the controller's DP dispatch.

Methods taking a `Batch` expect this DP rank's chunk (the controller's `dispatch_by_dp`) and
return results only on the output ranks (last pipeline stage, TP rank 0), None elsewhere.
The trainer decides the order of calls in a step; workers only turn batches into results.

    ActorRolloutRefWorker  compute_log_prob, compute_ref_log_prob, update_actor, save/load_checkpoint,
                           export_hf; `rollout` is the seam for the vLLM engine (hybridrl.rollout),
                           attached later with `attach_rollout` in the same processes
    CriticWorker           compute_values, update_critic, save/load_checkpoint
    RewardModelWorker      compute_rm_score
    TeacherWorker          compute_teacher_log_prob (on-policy distillation's frozen teacher)
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hybridrl.config.plan import Plan
from hybridrl.controller.base_worker import RankContext, Worker
from hybridrl.data.batch import Batch
from hybridrl.models.bridge import export_hf
from hybridrl.models.lora import PeftMerge, adapters_disabled, lora_adapters
from hybridrl.names import Phase, Role
from hybridrl.parallel.device import release_cached_blocks
from hybridrl.reshard.adapter_sync import gather_whole_adapters
from hybridrl.training.actor import MegatronActor, PolicyUpdateMetrics
from hybridrl.training.backend import MegatronBackend, role_spec
from hybridrl.training.checkpointing import load_role_checkpoint, save_role_checkpoint
from hybridrl.training.critic import CriticUpdateMetrics, MegatronCritic
from hybridrl.training.reward_model import MegatronRewardModel
from hybridrl.workers import faults

if TYPE_CHECKING:
    from hybridrl.rollout.engine import RolloutEngine

class UpdateMetrics(Protocol):
    """What every trained role's update returns across the worker seam (the actor's `PolicyUpdateMetrics`, the
    critic's `CriticUpdateMetrics`): the optimizer steps it took and skipped, and its metrics under the role's
    prefix, the same way for both, so the trainer reads them alike."""

    optimizer_steps: int
    skipped_steps: int

    def as_dict(self) -> dict[str, float]: ...


class MegatronWorker(Worker):
    """Common plumbing: the Plan, the rank's megatron backends, mesh coordinates, thread count."""

    BUILT_BY = "init_model"

    def __init__(self, context: RankContext, plan: Plan) -> None:
        super().__init__(context)
        self.plan = plan
        self.primary: MegatronBackend | None = None  # the backend that defines this rank's mesh

    def _prepare(self) -> None:
        # trainer.torch_threads_per_rank, or this node's cores shared among its ranks (never torch's
        # all-cores default).
        torch.set_num_threads(self.torch_threads(self.plan.config.trainer.torch_threads_per_rank))

    def _release(self) -> None:
        """Hand this process's cached free GPU blocks back to the driver: vLLM (in the actor's process, next to
        the critic's and reward model's) can only map memory the driver holds. No-op on CPU."""
        release_cached_blocks(self.plan.resolved.device)

    def _total_optimizer_steps(self, role: str, total_training_steps: int | None) -> int | None:
        if total_training_steps is None:
            return None
        return total_training_steps * self.plan.update(role).optimizer_steps_per_step

    def mesh_coords(self) -> dict[str, int]:
        return self._require(self.primary, "the model").mesh_coords()


class ActorRolloutRefWorker(MegatronWorker):
    """The hybrid engine's processes: policy training, reference log-probs and (later) the rollout."""

    def __init__(self, context: RankContext, plan: Plan, roles: tuple[str, ...] = (Role.ACTOR, Role.REF)) -> None:
        super().__init__(context, plan)
        unknown = set(roles) - {Role.ACTOR, Role.REF, "rollout"}
        if unknown:
            raise ValueError(f"unknown roles {sorted(unknown)} for ActorRolloutRefWorker")
        self.roles = tuple(roles)
        self.actor: MegatronActor | None = None
        self.ref: MegatronActor | None = None
        # The rollout engine (hybridrl.rollout) lives in these same processes; it is attached by
        # the trainer once it exists, and weight sync goes through the resharder (hybridrl.reshard).
        self.rollout: RolloutEngine | None = None

    def init_model(self, total_training_steps: int | None = None) -> None:
        self._prepare()
        if Role.ACTOR in self.roles:
            backend = MegatronBackend(role_spec(self.plan, Role.ACTOR),
                                  total_optimizer_steps=self._total_optimizer_steps(Role.ACTOR, total_training_steps))
            self.actor = MegatronActor(backend, self.plan)
            self.primary = backend
        if Role.REF in self.roles and self.plan.resolved.ref_enabled and self.actor is not None \
                and self.actor.backend.spec.lora is not None:
            # A LoRA actor's frozen base is the initial policy: the reference is it with the adapters off (one
            # model in memory, as verl's LoRA path does); its own pass settings (ref.log_prob_micro_batch_size...)
            self.ref = MegatronActor(self.actor.backend, self.plan, log_prob_pass="ref_log_prob",
                                     output_key="ref_log_probs")
        elif Role.REF in self.roles and self.plan.resolved.ref_enabled:
            # Same processes, so the same megatron layout as the actor (checked by the backend).
            backend = MegatronBackend(role_spec(self.plan, Role.REF))
            self.ref = MegatronActor(backend, self.plan, log_prob_pass="ref_log_prob", output_key="ref_log_probs")
            backend.offload_params()
            self.primary = self.primary or backend

    def attach_rollout(self, rollout: RolloutEngine) -> None:
        """Seam for the rollout engine built in this process by `hybridrl.rollout`."""
        self.rollout = rollout

    def _built_actor(self) -> MegatronActor:
        return self._require(self.actor, "the actor")

    def _ready_actor(self) -> MegatronActor:
        """The actor, its parameters on the device (back from the host with megatron.param_offload: every call
        that reads them starts here)."""
        actor = self._require(self.actor, "the actor")
        actor.backend.load_params()
        return actor

    def compute_log_prob(self, batch: Batch, with_entropy: bool = False) -> Batch | None:
        faults.crash_point(Phase.OLD_LOG_PROB)
        return self._ready_actor().compute_log_prob(batch, with_entropy)

    def compute_ref_log_prob(self, batch: Batch) -> Batch | None:
        ref = self._require(self.ref, "the reference policy")
        if self.actor is not None and ref.backend is self.actor.backend:  # a LoRA actor's base
            self._ready_actor()
            with adapters_disabled(ref.backend.chunks):
                return ref.compute_log_prob(batch)
        ref.backend.load_params()
        try:
            return ref.compute_log_prob(batch)
        finally:
            ref.backend.offload_params()

    def update_actor(self, batch: Batch) -> PolicyUpdateMetrics | None:
        actor = self._ready_actor()
        faults.crash_point(Phase.UPDATE_ACTOR)
        if faults.triggered(faults.NAN_UPDATE_ACTOR):
            batch["advantages"] = torch.full_like(batch["advantages"], float("nan"))
        metrics = actor.update_policy(batch)
        actor.backend.offload_training_state()  # idle until the next update (no-op unless configured)
        return metrics

    def save_checkpoint(self, path: str) -> str:
        saved = str(save_role_checkpoint(self._ready_actor().backend, Path(path) / Role.ACTOR))
        faults.crash_point(Phase.SAVE_CHECKPOINT)  # files written, checkpoint not yet sealed by the trainer
        return saved

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return load_role_checkpoint(self._ready_actor().backend, Path(path) / Role.ACTOR)

    def export_hf(self, path: str) -> str:
        """Collective: the current policy as an HF folder (written by rank 0); a LoRA actor's adapters merged into
        the weights they adapt (as `hybridrl convert` and peft's merge_and_unload do)."""
        backend = self._ready_actor().backend
        merge = None
        if backend.spec.lora is not None:
            adapters = gather_whole_adapters(lora_adapters(backend.chunks), backend.ctx)
            merge = PeftMerge.of(adapters.state, backend.spec.lora.scaling)
        return str(export_hf(backend.chunks, path, ctx=backend.ctx, force=True, adjust=merge))


class CriticWorker(MegatronWorker):
    def __init__(self, context: RankContext, plan: Plan) -> None:
        super().__init__(context, plan)
        self.critic: MegatronCritic | None = None

    def init_model(self, total_training_steps: int | None = None) -> None:
        self._prepare()
        backend = MegatronBackend(role_spec(self.plan, Role.CRITIC),
                              total_optimizer_steps=self._total_optimizer_steps(Role.CRITIC, total_training_steps))
        self.critic = MegatronCritic(backend, self.plan)
        self.primary = backend
        # built next to an awake vLLM (the hybrid engine comes up first): what the critic offloads
        # between its updates (critic.megatron.grad_offload / optimizer_offload) leaves from the start
        backend.offload_training_state()
        self._release()

    def compute_values(self, batch: Batch) -> Batch | None:
        try:
            return self._require(self.critic, "the critic").compute_values(batch)
        finally:
            self._release()

    def update_critic(self, batch: Batch) -> CriticUpdateMetrics | None:
        critic = self._require(self.critic, "the critic")
        try:
            metrics = critic.update_critic(batch)
            critic.backend.offload_training_state()  # idle until its next update (no-op unless configured)
            return metrics
        finally:
            self._release()

    def save_checkpoint(self, path: str) -> str:
        return str(save_role_checkpoint(self._require(self.critic, "the critic").backend, Path(path) / Role.CRITIC))

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return load_role_checkpoint(self._require(self.critic, "the critic").backend, Path(path) / Role.CRITIC)


class FrozenRoleWorker(MegatronWorker):
    """A frozen role in processes of its own (the reward model, the teacher): built once, then only scoring; with
    its `megatron.param_offload` its weights wait on the host between its passes (as the reference's always do)."""

    def _build_frozen(self, role: Role) -> MegatronBackend:
        self._prepare()
        backend = MegatronBackend(role_spec(self.plan, role))
        self.primary = backend
        return backend

    def _park(self, backend: MegatronBackend) -> None:
        """After set-up and after each pass: the weights to the host when offloaded, the rank's memory released."""
        if backend.spec.megatron.param_offload:
            backend.offload_params()
        self._release()

    @contextmanager
    def _scoring(self, backend: MegatronBackend) -> Iterator[None]:
        """One pass: the weights back from the host when offloaded, parked again after (also on failure)."""
        backend.load_params()
        try:
            yield
        finally:
            self._park(backend)


class RewardModelWorker(FrozenRoleWorker):
    def __init__(self, context: RankContext, plan: Plan) -> None:
        super().__init__(context, plan)
        self.reward_model: MegatronRewardModel | None = None

    def init_model(self) -> None:
        backend = self._build_frozen(Role.REWARD_MODEL)
        self.reward_model = MegatronRewardModel(backend, self.plan)
        self._park(backend)

    def compute_rm_score(self, batch: Batch) -> Batch | None:
        reward_model = self._require(self.reward_model, "the reward model")
        with self._scoring(reward_model.backend):
            return reward_model.compute_scores(batch)


class TeacherWorker(FrozenRoleWorker):
    """On-policy distillation's teacher: a frozen causal LM in its own processes and layout (`teacher.*`), scoring
    the student's sampled tokens (`teacher_log_probs`, at the rollout's temperature as the student's old
    log-probs are)."""

    def __init__(self, context: RankContext, plan: Plan) -> None:
        super().__init__(context, plan)
        self.teacher: MegatronActor | None = None

    def init_model(self) -> None:
        backend = self._build_frozen(Role.TEACHER)
        self.teacher = MegatronActor(backend, self.plan, log_prob_pass="teacher_log_prob",
                                     output_key="teacher_log_probs")
        self._park(backend)

    def compute_teacher_log_prob(self, batch: Batch) -> Batch | None:
        teacher = self._require(self.teacher, "the teacher")
        with self._scoring(teacher.backend):
            # top_k_forward_kl: also the teacher's top-k tokens at every response position; full_reverse_kl: its
            # log-probs of every id of the student's vocabulary there
            resolved, student = self.plan.resolved, self.plan.model
            full_vocab = 0
            if resolved.distillation_full_vocab:
                if student is None:  # a plan built without its model folder (plan --layout-only) trains nothing
                    raise RuntimeError("full_reverse_kl needs the student's vocabulary size: the plan has no model")
                full_vocab = student.vocab_size
            return teacher.compute_log_prob(batch, top_k=resolved.distillation_top_k, full_vocab=full_vocab)
