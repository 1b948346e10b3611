"""What the Ray driver imports: the trainer and the worker classes it ships, without megatron or vLLM.

The driver imports `hybridrl.workers.colocated`, `.policy`, `.critic` and `.frozen_roles` to hand their classes to
Ray; the workers import `hybridrl.training`, `hybridrl.models.bridge`, the resharder and the rollout
engine at their top, so those modules must keep megatron, vLLM and transformers inside their functions
(imported only on the ranks). torch and Ray are expected here.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("megatron", "vllm", "transformers", "transformer_engine")


def test_driver_imports_neither_megatron_nor_vllm():
    code = ("import sys, hybridrl.trainer.trainer, hybridrl.workers.colocated, hybridrl.workers.policy, "
            "hybridrl.workers.critic, hybridrl.workers.frozen_roles; "
            f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})); "
            "assert 'torch' in sys.modules and 'ray' in sys.modules; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
