"""Soak (short form of `bench/soak.py --steps 300`): the demo's memory stays flat and nothing is left behind.

The full 300-step figure is a benchmark (docs/reliability.md); this test runs the same script for
20 steps so CI checks the same promises on every change: no RSS growth above 5 % after warm-up in
the driver or any worker, and after exit no process of the run's session, no new /dev/shm entry
and no Ray temp folder left.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.worker_forkserver import plain_interpreters

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_short_soak_keeps_memory_flat_and_leaves_nothing(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, "bench/soak.py", "--steps", "20", "--warmup", "8", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, env=plain_interpreters(os.environ))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    workers = {k: v for k, v in result["rss_mib_after_warmup"].items() if k.startswith("worker:")}
    assert len(workers) == 2, result  # the demo runs two hybrid-engine workers; both were sampled
    growth = {name: 100.0 * (result["rss_mib_last"][name] - first) / first
              for name, first in result["rss_mib_after_warmup"].items()}
    assert "driver" in growth
    assert max(growth.values()) < 5.0, growth
    assert result["leftover_processes"] == []
    assert result["ray_temp_dirs_used"], result  # the run's own Ray folder was seen, so the check below means something
    assert result["shm_entries_left"] == []
    assert result["ray_temp_dirs_left"] == []
