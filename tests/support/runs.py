"""`hybridrl train` as a user runs it, for the end-to-end tests: a fresh subprocess (its own local Ray cluster, or the
test session's one as a user's run joins a running cluster), and what its metrics.jsonl holds."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from tests.support.worker_forkserver import python_command

ROOT = Path(__file__).resolve().parents[2]


def train(config: str, overrides: list[str], timeout: int = 900, env: dict[str, str] | None = None,
          unset: tuple[str, ...] = (), ray_address: str | None = None) -> subprocess.CompletedProcess:
    """`unset`: variables of this process's environment the run does not inherit (as a user's shell has none).
    `ray_address`: a running cluster the run joins (RAY_ADDRESS; the session's `ray_address` fixture), instead of
    starting its own (~4 s of each run here). A run whose workers must see `env` starts its own: Ray's workers
    inherit the environment of the cluster's processes, not the driver's."""
    inherited = {name: value for name, value in os.environ.items() if name not in unset}
    if ray_address is not None:
        assert not env, "the workers of a running cluster do not see the driver's environment"
        inherited["RAY_ADDRESS"] = ray_address
    else:
        inherited.pop("RAY_ADDRESS", None)
    run_env = {**inherited, **(env or {})}
    cmd = python_command(["-m", "hybridrl.cli", "train", config, *overrides, "--no-progress"], run_env)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=run_env)


def metrics(run: Path) -> list[dict]:
    """Every row of a run's metrics.jsonl (steps, validations, events)."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def session_left_running(session: int, wait_s: float) -> list[str]:
    """The command lines of the processes of `session` still running (zombies aside) once up to `wait_s` passed."""
    deadline = time.monotonic() + wait_s
    while True:
        listed = subprocess.run(["ps", "-o", "stat=,args=", "-s", str(session)], capture_output=True, text=True)
        alive = [line.split(None, 1)[-1] for line in listed.stdout.splitlines() if not line.strip().startswith("Z")]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)
