"""`hybridrl train`'s own command line and failure report: a user's mistake on the command line is one clear line
and exit 2, before any planning; a failure is one line on the terminal, the whole story in <run dir>/failure.log,
and the whole story on the terminal when the run folder cannot hold it (no second traceback about the file)."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import hybridrl.trainer.trainer as trainer_module
from hybridrl.trainer import train_cli
from tools.demo_assets import demo_overrides

CONFIG = str(Path(__file__).resolve().parents[2] / "configs/examples/cpu_tiny_grpo.yaml")


class _Failing:
    def __init__(self, plan, **_):
        self.plan = plan

    def fit(self):
        raise RuntimeError("a worker fell over\nits details")


def test_a_failure_report_the_run_folder_cannot_hold_goes_to_the_terminal(demo_assets, tmp_path, monkeypatch,
                                                                            capsys):
    blocked = tmp_path / "a_file"
    blocked.write_text("x")
    monkeypatch.setattr(trainer_module, "Trainer", _Failing)
    args = argparse.Namespace(config=CONFIG, overrides=demo_overrides(demo_assets, tmp_path / "run"),
                              no_progress=True, skip_version_check=True)
    assert train_cli.run(args) == 1
    log = tmp_path / "run" / "failure.log"
    assert "RuntimeError: a worker fell over" in log.read_text()
    assert f"the whole report: {log}" in capsys.readouterr().err

    monkeypatch.setattr(trainer_module, "run_dir_for", lambda plan: blocked / "run")  # (the plan refuses a file)
    assert train_cli.run(args) == 1
    err = capsys.readouterr().err
    assert "hybridrl train: RuntimeError: a worker fell over\n  the run folder could not hold failure.log" in err
    assert "the whole report:\nTraceback" in err and "its details" in err
    assert "FileExistsError" not in err.split("the run folder could not hold")[0]


def test_train_without_a_config_asks_for_it():
    done = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    # argparse said "the following arguments are required: config, overrides" (the overrides are optional)
    assert done.stderr.strip().startswith("hybridrl train: give the job's YAML config first (configs/examples/ has "
                                          "some), then any overrides (or every setting as overrides")


def test_train_takes_a_job_of_overrides_alone_as_plan_does(tmp_path):
    """verl's scripts give every setting on the command line: `train` read the first override as the config file's
    path ('file not found') where `plan`, and launch/train_grpo.sh's own plan, took the same line."""
    line = ["algorithm.adv_estimator=grpo", "trainer.seed=-1", f"trainer.run_dir={tmp_path / 'run'}"]
    for command in ("plan", "train"):
        done = subprocess.run([sys.executable, "-m", "hybridrl.cli", command, *line], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2, (command, done.stderr[-2000:])
        assert "<config file>" not in done.stderr  # read as overrides: the defaults, then these
        assert "trainer.seed=-1 must be in [0, 2**31)" in done.stderr, (command, done.stderr[-2000:])


def test_sigterm_and_sighup_stop_the_run_as_ctrl_c_does_once():
    """SLURM's and Kubernetes' SIGTERM and a closed terminal's SIGHUP raise a KeyboardInterrupt (what Ctrl-C raises, so
    the run's clean-up runs) where the main thread is, naming the signal; a repeat during the clean-up is ignored;
    a signal the process was told to ignore (`nohup`) stays ignored; the handlers found are put back after."""
    seen = []
    previous_term = signal.signal(signal.SIGTERM, lambda *_: seen.append("term"))
    previous_hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        outer_term = signal.getsignal(signal.SIGTERM)
        received: list[int] = []
        with pytest.raises(KeyboardInterrupt) as stopped:
            with train_cli.stop_signals_interrupt(received):
                os.kill(os.getpid(), signal.SIGHUP)  # ignored: nohup's choice stands
                os.kill(os.getpid(), signal.SIGTERM)
        assert isinstance(stopped.value, train_cli.Stopped) and received == [signal.SIGTERM]
        assert str(stopped.value) == "SIGTERM"

        received = []
        with pytest.raises(KeyboardInterrupt):
            with train_cli.stop_signals_interrupt(received):
                try:
                    signal.raise_signal(signal.SIGTERM)
                finally:  # the clean-up: a second SIGTERM must not cut it short
                    signal.raise_signal(signal.SIGTERM)
                    seen.append("clean-up finished")
        assert received == [signal.SIGTERM] and seen == ["clean-up finished"]
        assert signal.getsignal(signal.SIGTERM) is outer_term
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        signal.signal(signal.SIGHUP, previous_hup)


class _MetricsDiskFull(trainer_module.Trainer):
    """The real trainer, whose run saved step 2 (an empty checkpoint: no worker runs here), then writes step 3's
    metrics to a disk that is full: metrics.jsonl is a link to /dev/full, where every write fails with ENOSPC (the
    kernel's, as on a full disk)."""

    def fit(self):
        from hybridrl.names import Phase
        from hybridrl.trainer.tracking import Tracker

        self.checkpoints.commit(self.checkpoints.begin(2), 2, {})
        (self.run_dir / "metrics.jsonl").symlink_to("/dev/full")
        self.run.global_step, self.run.phase = 3, Phase.SYNC
        Tracker.create(["jsonl"], self.run_dir).log(3, {"x": 1.0})


def test_a_full_disk_is_one_line_naming_the_folders_and_where_the_next_run_goes_on_from(demo_assets, tmp_path,
                                                                                         monkeypatch, capsys):
    """A full run folder (or checkpoint disk) under the controller's own files ended in `OSError: [Errno 28] No space
    left on device`, its traceback, and a second failure writing failure.log on the same disk."""
    run = tmp_path / "run"
    args = argparse.Namespace(config=CONFIG, overrides=demo_overrides(demo_assets, run, "trainer.save_freq=2"),
                              no_progress=True, skip_version_check=True)
    checkpoints = run / "ckpt" / "demo" / "cpu_tiny_grpo"
    monkeypatch.setattr(trainer_module, "Trainer", _MetricsDiskFull)
    assert train_cli.run(args) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        f"hybridrl train: could not write at step 3 (sync): [Errno 28] No space left on device (the run folder is "
        f"{run}, the checkpoints go under {checkpoints}); the newest complete checkpoint is "
        f"{checkpoints / 'global_step_2'}: "
        "trainer.resume_mode=auto (the default) continues from it"), err
    assert "Traceback" not in err and not (run / "failure.log").exists()


def test_a_resume_whose_filtering_keeps_other_prompts_is_refused_before_ray(demo_assets, tmp_path, capsys):
    """Resumed with a data.max_prompt_length that filters out 174 of the demo's 512 prompts, the run started Ray, vLLM
    and every worker (4 minutes on the PPO demo here), then stopped with 'ValueError: the saved data loader state does
    not match this loader ... dataset_size: saved 512, now 338' (exit 1), naming no setting. train counts the kept
    prompts before Ray: a config error naming the field, both counts and the ways out (exit 2)."""
    import json

    from hybridrl.persistence import LATEST_FILE, ROLE_CHECKPOINT_FILE, STATE_FILE

    run = tmp_path / "run"
    folder = run / "ckpt" / "demo" / "cpu_tiny_grpo" / "global_step_2"  # as the trainer seals one
    (folder / "actor").mkdir(parents=True)
    (folder / "actor" / ROLE_CHECKPOINT_FILE).write_text("{}")
    loader = {"epoch": 0, "batches_done": 2, "seed": 42, "dataset_size": 512, "batch_size": 8, "shuffle": True,
              "drop_last": True}
    (folder / STATE_FILE).write_text(json.dumps({"global_step": 2, "dataloader": loader, "train_rows": 512}))
    (folder.parent / LATEST_FILE).write_text("2\n")
    args = argparse.Namespace(config=CONFIG, overrides=demo_overrides(demo_assets, run, "data.max_prompt_length=12"),
                              no_progress=True, skip_version_check=True)
    assert train_cli.run(args) == 2
    err = capsys.readouterr().err
    assert (f"data.max_prompt_length=12 leaves 338 prompts to train on (kept 338 of 512 prompts; filtered 174 of 512 "
            f"prompts longer than 12 tokens); the data loader of the checkpoint it resumes from ({folder}, step 2) "
            "saved 512 prompts: the saved data order cannot continue with another number of prompts") in err, err
    assert "start fresh with trainer.resume_mode=disable" in err and "Traceback" not in err
    assert not (run / "failure.log").exists()
