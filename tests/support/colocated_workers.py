"""The colocated policy worker on a forked gloo rank, as the trainer's Ray actor would build it.

Run inside `tests.support.forked.run_ranks`: the demo GRPO config with the test's overrides,
this rank's `RankContext`, and optional `ColocatedSettings` (e.g. a probe tolerance the test is not
about). `gather_first` hands the output ranks' result (None elsewhere) to every rank.
"""
from __future__ import annotations

from typing import Any

import torch


def colocated_worker(rank: int, world: int, model_dir: str, overrides: list[str], settings: Any = None) -> Any:
    from hybridrl.config import plan_from_sources
    from hybridrl.controller.base_worker import RankContext
    from hybridrl.workers.colocated import ColocatedPolicyWorker

    plan = plan_from_sources("configs/examples/cpu_tiny_grpo.yaml", [
        f"actor_rollout_ref.model.path={model_dir}", f"trainer.n_gpus_per_node={world}", *overrides])
    ctx = RankContext(group="actor_rollout_ref", rank=rank, world_size=world, node_rank=0, local_rank=rank,
                      local_world_size=world, use_gpu=False)
    return ColocatedPolicyWorker(ctx, plan, settings)


def gather_first(value: Any, world: int) -> Any:
    items = [None] * world
    torch.distributed.all_gather_object(items, value)
    return next(i for i in items if i is not None)
