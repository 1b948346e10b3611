#!/usr/bin/env python
"""Measured against predicted step time on this CPU: six `hybridrl train` runs with `trainer.hardware` set to this
machine's measured description (configs/hardware/this-cpu-2-ranks.yaml, `hybridrl hardware --measure --ranks 2`),
each phase's median over the steps after the first (`timing_s/<phase>`) beside the plan's prediction
(`time_vs_plan/<phase>` = measured / predicted, logged by the trainer every step).

The runs: the tiny demo job at DP2, TP2 and PP2, disaggregated one step ahead (a trainer rank and a rollout rank),
and the real model (SmolLM2-135M-Instruct) at DP2 and PP2. Needs `make demo-assets demo-real` (its model and data).

    python bench/time_vs_plan.py            # prints the table; writes bench/results/time_vs_plan.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from train_runs import train  # noqa: E402

RESULT = ROOT / "bench" / "results" / "time_vs_plan.json"
HARDWARE = "configs/hardware/this-cpu-2-ranks.yaml"
TINY = "configs/examples/cpu_tiny_grpo.yaml"
REAL = "configs/examples/smollm2_arith_grpo.yaml"
ARR = "actor_rollout_ref"
RUNS = (
    ("tiny DP2", TINY, []),
    ("tiny TP2", TINY, [f"{ARR}.actor.megatron.tensor_model_parallel_size=2"]),
    ("tiny PP2", TINY, [f"{ARR}.actor.megatron.pipeline_model_parallel_size=2"]),
    ("tiny disaggregated one_step_off", TINY, [
        "trainer.n_gpus_per_node=1", f"{ARR}.rollout.mode=disaggregated", f"{ARR}.rollout.n_gpus_per_node=1",
        f"{ARR}.rollout.async_mode=one_step_off", f"{ARR}.actor.ppo_micro_batch_size_per_gpu=16"]),
    ("SmolLM2-135M DP2", REAL, []),
    ("SmolLM2-135M PP2", REAL, [f"{ARR}.actor.megatron.pipeline_model_parallel_size=2"]),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, config, overrides) in enumerate(RUNS):
            settings = [f"trainer.hardware={HARDWARE}", f"trainer.total_training_steps={args.steps}",
                        "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.val_before_train=false"]
            run = train(config, [*overrides, *settings], Path(tmp) / f"run{i}")
            later = run.steps[1:]  # the first step warms up (allocations, first compilations)
            phases = sorted({key.removeprefix("time_vs_plan/") for r in later for key in r
                             if key.startswith("time_vs_plan/")})
            figures = {}
            for phase in phases:
                measured = statistics.median(r[f"timing_s/{phase}"] for r in later if f"timing_s/{phase}" in r)
                ratio = statistics.median(r[f"time_vs_plan/{phase}"] for r in later if f"time_vs_plan/{phase}" in r)
                figures[phase] = {"measured_s": round(measured, 4), "predicted_s": round(measured / ratio, 5),
                                  "measured_over_predicted": round(ratio, 2)}
            rows.append({"run": name, "config": config, "overrides": overrides, "steps": len(run.steps),
                         "phases": figures})
            print(f"{name}: " + ", ".join(f"{p} {f['measured_s']:.3g} s / {f['predicted_s']:.3g} s = "
                                          f"x{f['measured_over_predicted']}" for p, f in figures.items()), flush=True)
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({"hardware": HARDWARE, "runs": rows}, indent=2) + "\n")
    print(f"wrote {RESULT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
