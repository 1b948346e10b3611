"""One `hybridrl train` run for a benchmark, as a user runs it, and what its metrics.jsonl holds.

Shared by the benchmarks that measure whole runs on the real model (bench/lora.py, bench/distillation.py): the
run in a subprocess with its run and checkpoint folders under the benchmark's, a failure stopping the benchmark
with the run's output, and the metrics split into training steps and validations.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class TrainRun:
    steps: list[dict]  # one row a training step (validation-only and event rows left out)
    validation: list[dict]  # the rows with val/score/mean, in order
    wall_s: float  # the whole `hybridrl train`, start-up and validations included

    def phase_share(self, phases: tuple[str, ...]) -> dict[str, float]:
        """Each phase's share of the summed step times."""
        total = sum(r["timing_s/step"] for r in self.steps)
        return {p: round(sum(r.get(f"timing_s/{p}", 0.0) for r in self.steps) / total, 3) for p in phases}


def train(config: str, overrides: list[str], run_dir: Path) -> TrainRun:
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "hybridrl.cli", "train", config, f"trainer.run_dir={run_dir}",
           f"trainer.default_local_dir={run_dir / 'ckpt'}", *overrides, "--no-progress"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{run_dir.name}: train failed\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return read_run(run_dir, time.perf_counter() - started)


def read_run(run_dir: Path, wall_s: float) -> TrainRun:
    """A finished run's metrics.jsonl, split."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "event" not in r and r.get("step", 0) > 0 and "critic/score/mean" in r]
    return TrainRun(steps, [r for r in rows if "val/score/mean" in r], round(wall_s, 1))
