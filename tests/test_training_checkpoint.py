"""Role checkpoints: save -> load restores model, optimizer, LR schedule and RNG exactly.

Run A trains one step, saves, then trains a second step. Run B starts from the initial weights,
loads A's checkpoint and trains the same second step: its metrics and weights must equal A's bit
for bit, and its RNG streams must continue where A's stopped. TP2 x DP2 with the distributed
optimizer (sharded Adam state) and a warmup schedule (the lr differs per step).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridrl.parallel.forked import run_ranks
from tests.test_training_fixtures import (
    job_config,
    policy_model,
    rollout_batch,
    sequence_classifier,
    trained_role,
    with_critic,
)


def _rank(rank: int, world: int, config: Any, batches: list[Any], ckpt: str, mode: str, role: str) -> Any:
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    from hybridrl.models.checkpoint import tensor_sha256
    from hybridrl.training.checkpointing import load_role_checkpoint, save_role_checkpoint

    backend, update, chunks = trained_role(config, role, batches)
    if mode == "save":
        update(chunks[0])
        # Advance every RNG stream (as sampling or dropout would) so that a restore is visible.
        torch.rand(7), random.random(), np.random.rand()
        with tensor_parallel.get_cuda_rng_tracker().fork():
            torch.rand(7)
        save_role_checkpoint(backend, ckpt)
    else:
        load_role_checkpoint(backend, ckpt)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracker_draw = torch.rand(3)
    draws = (torch.rand(3), tracker_draw, torch.tensor([random.random(), np.random.rand()]))
    metrics = update(chunks[1])
    digests = {n: tensor_sha256(p.detach()) for c in backend.chunks for n, p in c.named_parameters()}
    return {"metrics": metrics, "draws": draws, "digests": digests, "lr": backend.schedule.current_lr}


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_round_trip_gives_identical_next_update(tmp_path, role):
    hf = policy_model(tmp_path / "hf")
    config = job_config(hf, world=4, tp=2, distributed_optimizer=True)
    config.actor_rollout_ref.actor.optim.lr_warmup_steps = 4
    if role == "critic":
        config = with_critic(config, sequence_classifier(tmp_path / "critic"), tp=2)
        config.critic.megatron.use_distributed_optimizer = True
        config.critic.optim.lr_warmup_steps = 4
    batches = [rollout_batch(8, seed=1), rollout_batch(8, seed=2)]
    ckpt = str(tmp_path / "ckpt")
    first = run_ranks(_rank, 4, config, batches, ckpt, "save", role)
    second = run_ranks(_rank, 4, config, batches, ckpt, "load", role)
    for a, b in zip(first, second):
        assert a["digests"] == b["digests"]
        assert all(torch.equal(x, y) for x, y in zip(a["draws"], b["draws"]))
        assert a["lr"] == b["lr"]
        assert a["metrics"] == b["metrics"]
    lrs = [s["lr"] for r in first if r["metrics"] is not None for s in r["metrics"].per_step]
    assert lrs and lrs[0] == pytest.approx(1e-2 * 2 / 4)  # the second optimizer step of the warmup
