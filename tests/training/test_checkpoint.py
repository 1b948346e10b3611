"""Role checkpoints: save -> load restores model, optimizer, LR schedule and RNG exactly.

Run A trains one step, saves, then trains a second step. Run B starts from the initial weights,
loads A's checkpoint and trains the same second step: its metrics and weights must equal A's bit
for bit, and its RNG streams must continue where A's stopped. TP2 x DP2 with the distributed
optimizer (sharded Adam state) and a warmup schedule (the lr differs per step).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.forked import run_ranks
from tests.support.training_fixtures import (
    job_config,
    policy_model,
    rollout_batch,
    sequence_classifier,
    trained_role,
    with_critic,
)


def _rank(rank: int, world: int, config: Any, batches: list[Any], ckpt: str, mode: str, role: str) -> Any:
    import random
    import warnings

    import numpy as np
    from megatron.core import tensor_parallel

    from hybridrl.models.checkpoint import tensor_sha256
    from hybridrl.training.backend import NON_LEAF_GRAD_WARNING
    from hybridrl.training.checkpointing import load_role_checkpoint, save_role_checkpoint

    backend, update, chunks = trained_role(config, role, batches)
    warned = {}
    if mode == "save":
        for case, call in (("megatron", backend.optimizer.zero_grad), ("update", lambda: update(chunks[0]))):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                call()
            warned[case] = any(NON_LEAF_GRAD_WARNING in str(w.message) for w in seen)
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
    return {"metrics": metrics, "draws": draws, "digests": digests, "lr": backend.schedule.current_lr,
            "warned": warned}


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
    # megatron's distributed optimizer reads `.grad` of its shard views when it zeroes them: torch warns (the control,
    # its zero_grad called alone first), the update, which zeroes them the same way, does not (train_step's filter)
    assert [r["warned"] for r in first] == [{"megatron": True, "update": False}] * 4
    lrs = [s["lr"] for r in first if r["metrics"] is not None for s in r["metrics"].per_step]
    assert lrs and lrs[0] == pytest.approx(1e-2 * 2 / 4)  # the second optimizer step of the warmup


def _moe_rank(rank: int, world: int, config: Any, batches: list[Any], ckpt: str, mode: str, out: str) -> Any:
    """An expert-parallel actor: `save` trains one step, saves, trains the second; `load` loads and trains
    the second. Either way the second step's metrics, and the weights after it (exported to `out`)."""
    from hybridrl.models.bridge import export_hf
    from hybridrl.models.checkpoint import tensor_sha256
    from hybridrl.training.checkpointing import load_role_checkpoint, save_role_checkpoint

    backend, update, chunks = trained_role(config, "actor", batches)
    if mode == "save":
        update(chunks[0])
        save_role_checkpoint(backend, ckpt)
    else:
        load_role_checkpoint(backend, ckpt)
    metrics = update(chunks[1])
    export_hf(backend.chunks, out, force=True)
    return {"metrics": metrics,
            "digests": {n: tensor_sha256(p.detach()) for c in backend.chunks for n, p in c.named_parameters()}}


@pytest.mark.slow
def test_expert_parallel_round_trips(tmp_path):
    """Role checkpoints of expert-parallel actors: the train_state files follow the bridge's rank file
    positions (one per slot: EP2's two EP ranks, TP1 x ETP2's two expert halves), each tensor's Adam state
    written by its first holder. Resumed on the saved layout the next update is bit-identical (before,
    EP rank 1 restored EP rank 0's expert state from the one file per TP x PP position: 24 expert weights
    came out different); an EP2 checkpoint resumed at TP1 x ETP2 re-shards the experts' state and gives the
    same next update (<= 1e-5)."""
    from tests.support.models_fixtures import make_hf_model, safetensors_state

    hf = make_hf_model(tmp_path / "hf", "qwen3_moe", seed=7)
    batches = [rollout_batch(8, seed=1), rollout_batch(8, seed=2)]

    def config(ep: int, etp: int | None) -> Any:
        c = job_config(hf, world=2, distributed_optimizer=True)
        c.actor_rollout_ref.actor.megatron.expert_model_parallel_size = ep
        c.actor_rollout_ref.actor.megatron.expert_tensor_parallel_size = etp
        return c

    def run(name: str, ep: int, etp: int | None, ckpt: str, mode: str) -> tuple[list[Any], dict]:
        out = tmp_path / name
        results = run_ranks(_moe_rank, 2, config(ep, etp), batches, ckpt, mode, str(out), timeout_s=400)
        return results, safetensors_state(out)

    for ep, etp in ((2, None), (1, 2)):
        ckpt = str(tmp_path / f"ckpt_ep{ep}_etp{etp}")
        first, first_state = run(f"a{ep}{etp}", ep, etp, ckpt, "save")
        saved = sorted(p.name for p in (Path(ckpt) / "train_state").glob("*.safetensors"))
        assert saved == ["state_tp00_pp000_ep000.safetensors", "state_tp00_pp000_ep001.safetensors"] if ep == 2 \
            else ["state_tp00_pp000_ep000_etp00.safetensors", "state_tp00_pp000_ep000_etp01.safetensors"]
        second, second_state = run(f"b{ep}{etp}", ep, etp, ckpt, "load")
        for a, b in zip(first, second):
            assert a["digests"] == b["digests"], [n for n in a["digests"] if a["digests"][n] != b["digests"][n]][:4]
            assert a["metrics"] == b["metrics"]
        differ = [n for n in first_state if not torch.equal(first_state[n], second_state[n])]
        assert not differ, differ[:4]
        if ep == 2:
            reference, reference_metrics = first_state, first[0]["metrics"]
    moved, _ = run("c", 1, 2, str(tmp_path / "ckpt_ep2_etpNone"), "load")
    moved_state = safetensors_state(tmp_path / "c")
    assert abs(moved[0]["metrics"].pg_loss - reference_metrics.pg_loss) <= 1e-6
    assert abs(moved[0]["metrics"].grad_norm - reference_metrics.grad_norm) <= 1e-5
    for name, value in reference.items():
        assert (moved_state[name] - value).abs().max() <= 1e-5, name
