"""LoRA against full fine-tuning on the real model, as `make demo-real` trains it (SmolLM2-135M-Instruct, GRPO on
arithmetic word problems, 2 CPU ranks): the same job twice, once with `actor_rollout_ref.model.lora.*` set, each
with greedy validation before the first step and after the last. Reads each run's metrics.jsonl and prints, per
run: validation score before and after, the reward of the first and last steps, median step time and each
phase's share, the update's memory (torch's allocation on the actor's rank after the update, as the trainer
logs it) and the largest probe gap of a sync (the merged weights in vLLM against the trainer's adapted model).
A LoRA run with `lora.merge=false` (vLLM serving the adapters itself) is added per `--served-lr`: its sync moves
the adapters alone, its generation applies them on the fly; the median generation and sync times and the bytes a
sync moves are recorded for every run. Writes bench/results/lora.json.

    make real-model && python tools/make_arith_data.py --out-dir data/arith --val-rows 64
    python bench/lora.py [--steps 12] [--rank 16] [--alpha 32] [--lora-lr 3e-4 1e-3] [--served-lr 3e-4] [--out F]
    python bench/lora.py --steps 40 --lora-lr 3e-4 --served-lr --out bench/results/lora_long.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.train_runs import train  # noqa: E402

CONFIG = "configs/examples/smollm2_arith_grpo.yaml"
PHASES = ("gen", "ref", "update_actor", "sync")


def run(name: str, overrides: list[str], out: Path) -> dict:
    done = train(CONFIG, overrides, out / name)
    steps, validation = done.steps, done.validation
    step_times = [r["timing_s/step"] for r in steps]
    return {
        "overrides": overrides,
        "val_before": validation[0]["val/score/mean"], "val_after": validation[-1]["val/score/mean"],
        "reward_first_3": statistics.fmean(r["critic/score/mean"] for r in steps[:3]),
        "reward_last_3": statistics.fmean(r["critic/score/mean"] for r in steps[-3:]),
        "median_step_s": statistics.median(step_times),
        "phase_share": done.phase_share(PHASES),
        "update_after_allocated_gib": max(r.get("memory/update_after_allocated_gib", 0.0) for r in steps),
        "max_probe_gap": max(r["reshard/probe_max_abs_gap"] for r in steps),
        "median_gen_s": statistics.median(r["timing_s/gen"] for r in steps),
        "median_sync_s": statistics.median(r["timing_s/sync"] for r in steps),
        # what a step's sync moved into vLLM: the adapters alone when vLLM serves them, else every rank's shard
        "sync_bytes_per_rank": max(r.get("reshard/adapter_bytes", r.get("reshard/generation_shard_bytes", 0))
                                   for r in steps),
        "wall_s": done.wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--lora-lr", type=float, nargs="+", default=[3e-4, 1e-3])
    parser.add_argument("--served-lr", type=float, nargs="*", default=[3e-4],
                        help="one run per lr with lora.merge=false (vLLM serving the adapters)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/lora.json")
    args = parser.parse_args()
    common = [f"trainer.total_training_steps={args.steps}", f"trainer.test_freq={args.steps}"]
    lora = [f"actor_rollout_ref.model.lora.rank={args.rank}", f"actor_rollout_ref.model.lora.alpha={args.alpha}"]
    with tempfile.TemporaryDirectory() as tmp:
        results = {"full": run("full", common, Path(tmp))}
        for lr in args.lora_lr:
            results[f"lora_lr_{lr:g}"] = run(f"lora_{lr:g}", common + lora + [f"actor_rollout_ref.actor.optim.lr={lr}"],
                                             Path(tmp))
        for lr in args.served_lr:
            results[f"lora_served_lr_{lr:g}"] = run(
                f"lora_served_{lr:g}", common + lora + [f"actor_rollout_ref.actor.optim.lr={lr}",
                                                        "actor_rollout_ref.model.lora.merge=false"], Path(tmp))
    print(f"{'run':<14}{'val before':>11}{'val after':>10}{'reward 1-3':>11}{'last 3':>8}{'step s':>8}"
          f"{'update GiB':>11}{'probe gap':>10}{'gen s':>7}{'sync s':>7}{'sync MB':>8}")
    for name, r in results.items():
        print(f"{name:<14}{r['val_before']:>11.3f}{r['val_after']:>10.3f}{r['reward_first_3']:>11.3f}"
              f"{r['reward_last_3']:>8.3f}{r['median_step_s']:>8.2f}{r['update_after_allocated_gib']:>11.3f}"
              f"{r['max_probe_gap']:>10.2e}{r['median_gen_s']:>7.2f}{r['median_sync_s']:>7.2f}"
              f"{r['sync_bytes_per_rank'] / 1e6:>8.1f}")
    args.out.write_text(json.dumps({"config": CONFIG, "steps": args.steps, "runs": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
