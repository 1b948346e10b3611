"""How a role worker builds its megatron backend and parks it between uses: one place for every role.

- `trained_backend`: a role that trains (the actor, the critic); its LR schedule spans the run's optimizer steps.
- `FrozenBackend`: a role that only scores (the reference, the reward model, the teacher): between its passes its
  weights wait on the host when `megatron.param_offload` says so (the colocated reference's always do, as they
  share the GPU with the actor and vLLM), and the rank's cached free blocks go back to the driver.
- `UpdateMetrics`: what every trained role's update returns across the worker seam.
- `mesh_coord`: where a backend's parallel state puts its rank, as the controller's DP dispatch reads it.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from hybridrl.config.plan import Plan
from hybridrl.controller.dispatch import MeshCoord
from hybridrl.names import Role
from hybridrl.parallel.device import release_cached_blocks
from hybridrl.training.backend import MegatronBackend, role_spec


class UpdateMetrics(Protocol):
    """What every trained role's update returns across the worker seam (the actor's `PolicyUpdateMetrics`, the
    critic's `CriticUpdateMetrics`): the optimizer steps it took and skipped, and its metrics under the role's
    prefix, the same way for both, so the trainer reads them alike."""

    optimizer_steps: int
    skipped_steps: int

    def as_dict(self) -> dict[str, float]: ...


def trained_backend(plan: Plan, role: Role, total_training_steps: int | None) -> MegatronBackend:
    """The backend of a trained `role`; its LR schedule's length is the run's steps x the role's optimizer steps a
    step (None: a worker built without a run, whose schedule never decays), which a resume rescales a checkpoint's
    position by where it took another number a step."""
    per_step = plan.update(role).optimizer_steps_per_step
    total = None if total_training_steps is None else total_training_steps * per_step
    return MegatronBackend(role_spec(plan, role), total_optimizer_steps=total, optimizer_steps_per_step=per_step)


def mesh_coord(backend: MegatronBackend) -> MeshCoord:
    return MeshCoord(**backend.mesh_coords())


class FrozenBackend:
    """A frozen role's backend and where its weights wait between passes."""

    def __init__(self, backend: MegatronBackend, device: str, *, host_between_passes: bool) -> None:
        self.backend = backend
        self.device = device
        self.host_between_passes = host_between_passes

    @classmethod
    def build(cls, plan: Plan, role: Role, *, host_between_passes: bool | None = None) -> FrozenBackend:
        """The role's backend, built and parked; its weights wait on the host between passes when
        `host_between_passes` says so (None: its `megatron.param_offload`)."""
        backend = MegatronBackend(role_spec(plan, role))
        host = backend.spec.megatron.param_offload if host_between_passes is None else host_between_passes
        frozen = cls(backend, plan.resolved.device, host_between_passes=host)
        frozen.park()
        return frozen

    def park(self) -> None:
        """After set-up and after each pass: the weights to the host when they wait there, the rank's cached free
        blocks back to the driver (vLLM, in the same process or beside it, maps only what the driver holds)."""
        if self.host_between_passes:
            self.backend.offload_params()
        release_cached_blocks(self.device)

    @contextmanager
    def scoring(self) -> Iterator[MegatronBackend]:
        """One pass: the weights back from the host when they waited there, parked again after (also on failure)."""
        self.backend.load_params()
        try:
            yield self.backend
        finally:
            self.park()
