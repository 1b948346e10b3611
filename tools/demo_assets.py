"""The demo's model folder and data in one folder, and the `hybridrl train` overrides that point at them.

Shared by the test session (`tests/conftest.py::demo_assets`, the end-to-end tests) and the soak
benchmark, so they build and run exactly what `make demo` does, only somewhere else:

    base/model/             tools/make_demo_model.py (random weights, character tokenizer)
    base/data/{train,val}.jsonl   tools/make_demo_data.py
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_demo_assets(base: Path, train_rows: int = 512, val_rows: int = 16) -> Path:
    """Write the demo model and data under `base` (each tool in its own process, as `make demo` runs it)."""
    py = sys.executable
    subprocess.run([py, "tools/make_demo_model.py", "--out", str(base / "model")], cwd=ROOT, check=True,
                   capture_output=True)
    subprocess.run([py, "tools/make_demo_data.py", "--out-dir", str(base / "data"), "--train-rows", str(train_rows),
                    "--val-rows", str(val_rows)], cwd=ROOT, check=True, capture_output=True)
    return base


def demo_overrides(assets: Path, run: Path, *extra: str) -> list[str]:
    """Overrides for a demo config: the assets' model and data, `run` for the run and its checkpoints."""
    return [
        f"actor_rollout_ref.model.path={assets / 'model'}",
        f"data.train_files=[{assets / 'data' / 'train.jsonl'}]",
        f"data.val_files=[{assets / 'data' / 'val.jsonl'}]",
        f"trainer.run_dir={run}", f"trainer.default_local_dir={run / 'ckpt'}",
        "trainer.test_freq=-1", *extra,
    ]
