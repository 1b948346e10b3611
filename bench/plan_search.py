#!/usr/bin/env python
"""`hybridrl plan --search` on the shipped examples: how many layouts, how long, and what it finds.

For each job (the seed articles' 6-GPU GRPO, Qwen2.5-7B GRPO on 8 GPUs, Llama-3-70B PPO on 16 x 8 and on 128 x 8 =
1,024 GPUs), on `h100-sxm`: the layouts searched, the plans built, the search's own time in a fresh process (its
first search: nothing cached yet) and the whole command's wall time (`python -m hybridrl.cli plan --search`,
interpreter start and imports included); the job's own predicted step time and the best found, with its layout.

    python bench/plan_search.py            # prints the figures; writes bench/results/plan_search.json
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "plan_search.json"
EXAMPLES = "configs/examples"
JOBS = (
    ("seed 6-GPU GRPO (Qwen2.5-0.5B)", f"{EXAMPLES}/seed_6gpu_grpo.yaml", []),
    ("Qwen2.5-7B GRPO, 8 GPUs", f"{EXAMPLES}/qwen2.5_7b_grpo_8gpu.yaml", []),
    ("Llama-3-70B PPO, 16 x 8", f"{EXAMPLES}/llama3_70b_ppo_16x8.yaml", []),
    ("Llama-3-70B PPO, 128 x 8 = 1,024 GPUs", f"{EXAMPLES}/llama3_70b_ppo_16x8.yaml", ["trainer.nnodes=128"]),
)
HARDWARE = "h100-sxm"

# One search in a fresh interpreter: its own time, nothing cached by an earlier search.
FRESH = """
import json, sys, time
from hybridrl.config.search import search_from_sources
start = time.perf_counter()
result = search_from_sources(sys.argv[1], sys.argv[2:])
seconds = time.perf_counter() - start
best, written = result.ranked[0], result.written
print(json.dumps({
    "layouts": result.layouts, "plans": result.planned, "planned_layouts": len(result.ranked),
    "search_s": round(seconds, 3),
    "best_step_s": round(best.step.seconds, 3), "best_overrides": best.overrides(),
    "best_layout": {"train_tp": best.layout.train_tp, "train_pp": best.layout.train_pp, "train_dp": best.train_dp,
                    "rollout_tp": best.layout.rollout_tp, "rollout_pool_gpus": best.layout.rollout_gpus,
                    "async_mode": best.layout.async_mode, "savers": best.savers, "peak_gib": best.peak_gib},
    "best_phases_s": {p.phase: round(p.seconds, 3) for p in best.step.phases},
    "written_step_s": round(written.step.seconds, 3) if written else None,
    "written_phases_s": {p.phase: round(p.seconds, 3) for p in written.step.phases} if written else None,
}))
"""


def main() -> None:
    rows = []
    for name, config, overrides in JOBS:
        args = [config, *overrides, f"trainer.hardware={HARDWARE}"]
        fresh = subprocess.run([sys.executable, "-c", FRESH, *args], cwd=ROOT, capture_output=True, text=True,
                               check=True)
        row = {"job": name, "config": config, "overrides": overrides, **json.loads(fresh.stdout)}
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "hybridrl.cli", "plan", "--search", *args], cwd=ROOT,
                       capture_output=True, text=True, check=True)
        row["command_s"] = round(time.perf_counter() - start, 3)
        rows.append(row)
        layout = row["best_layout"]
        print(f"{name}: {row['layouts']} layouts ({row['plans']} plans, {row['planned_layouts']} plan) searched in "
              f"{row['search_s']:.2f} s (the whole command {row['command_s']:.2f} s); the job as written "
              f"{row['written_step_s']} s a step, the best {row['best_step_s']} s: train TP{layout['train_tp']} "
              f"PP{layout['train_pp']} DP{layout['train_dp']}, vLLM TP{layout['rollout_tp']}, "
              + (f"rollout pool {layout['rollout_pool_gpus']} GPUs {layout['async_mode']}"
                 if layout["rollout_pool_gpus"] else "colocated"))
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({"hardware": HARDWARE, "machine": platform.processor() or platform.machine(),
                                  "python": platform.python_version(), "jobs": rows}, indent=2) + "\n")
    print(f"wrote {RESULT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
