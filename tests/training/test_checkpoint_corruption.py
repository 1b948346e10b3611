"""Corrupted checkpoints are refused with an error naming the file, and loading them writes nothing.

A real role checkpoint (one rank, megatron actor with Adam state) is saved, then damaged in the
ways disks and people damage files: a flipped byte in a rank's RNG/schedule file, a truncated
file, a missing file, a tampered weight shard, a tampered optimizer-state shard, an unreadable
trainer state.
"""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import pytest

from hybridrl.trainer.checkpoints import STATE_FILE, CheckpointError, CheckpointManager
from tests.support.forked import run_ranks
from tests.support.training_fixtures import job_config, policy_model, rollout_batch


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _damage(good: Path, where: Path, how: str) -> Path:
    bad = where / how
    shutil.copytree(good, bad)
    rank_file = bad / "rank_00000.pt"
    if how == "flipped_byte":
        data = bytearray(rank_file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        rank_file.write_bytes(bytes(data))
    elif how == "truncated":
        rank_file.write_bytes(rank_file.read_bytes()[:1000])
    elif how == "missing":
        rank_file.unlink()
    elif how == "tampered_state":
        state = bad / "train_state" / "state_tp00_pp000.safetensors"
        data = bytearray(state.read_bytes())
        data[-5] ^= 0xFF  # inside the last tensor's data (Adam state), past the header
        state.write_bytes(bytes(data))
    elif how == "tampered_weights":
        shard = next((bad / "model").glob("*.safetensors"))
        data = bytearray(shard.read_bytes())
        data[-5] ^= 0xFF  # inside the last tensor's data, past the header
        shard.write_bytes(bytes(data))
    return bad


def _rank(rank: int, world: int, config: Any, batch: Any, root: str) -> dict[str, str]:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec
    from hybridrl.training.checkpointing import load_role_checkpoint, save_role_checkpoint

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    MegatronActor(backend, plan).update_policy(batch)
    good = save_role_checkpoint(backend, Path(root) / "good")
    errors = {}
    for how in ("flipped_byte", "truncated", "missing", "tampered_weights", "tampered_state"):
        bad = _damage(good, Path(root), how)
        before = _digests(bad)
        try:
            load_role_checkpoint(backend, bad)
            errors[how] = "loaded"
        except Exception as exc:  # noqa: BLE001 - the message is what is checked
            errors[how] = f"{type(exc).__name__}: {exc}"
        assert _digests(bad) == before, f"loading {how} changed files on disk"
    load_role_checkpoint(backend, good)  # the intact one still loads
    return errors


def test_damaged_role_checkpoint_names_the_file(tmp_path):
    hf = policy_model(tmp_path / "hf")
    errors = run_ranks(_rank, 1, job_config(hf, world=1), rollout_batch(8, seed=1), str(tmp_path))[0]
    assert "rank_00000.pt: sha256" in errors["flipped_byte"] and "modified or truncated" in errors["flipped_byte"]
    assert "rank_00000.pt: sha256" in errors["truncated"]
    assert "rank_00000.pt is missing" in errors["missing"]
    assert "checksum mismatch in" in errors["tampered_weights"] and "model_tp00_pp000.safetensors" in errors[
        "tampered_weights"], errors
    assert "checksum mismatch in" in errors["tampered_state"] and "state_tp00_pp000.safetensors" in errors[
        "tampered_state"], errors


@pytest.mark.parametrize("content", ["{not json", "[]", '{"global_step": "3"}'])
def test_unreadable_trainer_state_names_the_file(tmp_path, content):
    step = tmp_path / "global_step_3"
    step.mkdir()
    (step / STATE_FILE).write_text(content)
    with pytest.raises(CheckpointError, match=str(step / STATE_FILE)):
        CheckpointManager.read_state(step)
