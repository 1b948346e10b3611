"""The critic's processes (PPO's value model, `critic.*`): values for GAE and its own update, at its own layout.

Colocated with the policy on the same GPUs in the colocated mode: what it offloads between its updates
(`critic.megatron.grad_offload` / `optimizer_offload`) leaves from the start, and after every call it hands its cached
free blocks back to the driver for vLLM.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridrl.config.plan import Plan
from hybridrl.controller.base_worker import RankContext, Worker
from hybridrl.controller.dispatch import MeshCoord
from hybridrl.data.batch import Batch
from hybridrl.names import Role
from hybridrl.parallel.device import release_cached_blocks
from hybridrl.training.checkpointing import load_role_checkpoint, save_role_checkpoint
from hybridrl.training.critic import CriticUpdateMetrics, MegatronCritic
from hybridrl.workers.backends import mesh_coord, trained_backend


class CriticWorker(Worker):
    BUILT_BY = "init_model"

    def __init__(self, context: RankContext, plan: Plan) -> None:
        super().__init__(context)
        self.plan = plan
        self.critic: MegatronCritic | None = None

    def _built_critic(self) -> MegatronCritic:
        return self._require(self.critic, "the critic")

    def _release(self) -> None:
        release_cached_blocks(self.plan.resolved.device)

    def init_model(self, total_training_steps: int | None = None) -> None:
        self.use_torch_threads(self.plan.config.trainer.torch_threads_per_rank)
        backend = trained_backend(self.plan, Role.CRITIC, total_training_steps)
        self.critic = MegatronCritic(backend, self.plan)
        # built next to an awake vLLM (the colocated policy comes up first): what the critic offloads
        # between its updates (critic.megatron.grad_offload / optimizer_offload) leaves from the start
        backend.offload_training_state()
        self._release()

    def mesh_coords(self) -> MeshCoord:
        return mesh_coord(self._built_critic().backend)

    def compute_values(self, batch: Batch) -> Batch | None:
        try:
            return self._built_critic().compute_values(batch)
        finally:
            self._release()

    def update_critic(self, batch: Batch) -> CriticUpdateMetrics | None:
        critic = self._built_critic()
        try:
            metrics = critic.update_critic(batch)
            critic.backend.offload_training_state()  # idle until its next update (no-op unless configured)
            return metrics
        finally:
            self._release()

    def save_checkpoint(self, path: str) -> str:
        return str(save_role_checkpoint(self._built_critic().backend, Path(path) / Role.CRITIC))

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return load_role_checkpoint(self._built_critic().backend, Path(path) / Role.CRITIC)
