"""On-policy distillation from a real model, as `make demo-distill` runs it: a 4-layer student of SmolLM2-135M-Instruct
(`tools/make_distill_student.py`) distilled from SmolLM2-135M-Instruct on the arithmetic word problems, pure
distillation (the reward logged, never trained on), 2 CPU ranks, greedy validation on 64 problems before the first
step and after the last, with one `algorithm.distillation.loss` (`--loss`). Reads the run's metrics.jsonl and
prints: the reverse KL per token (student - teacher log-prob of each sampled token) and, with a loss term
(top_k_forward_kl, full_reverse_kl), that term over the first and the last steps, the greedy validation score
before and after, the sampled reward of the first and last steps, the median step time and each phase's share
(the teacher's pass among them), the wall time. Writes the run under its loss's name in
bench/results/distillation.json (the other losses' runs kept).

    make real-model && python tools/make_arith_data.py --out-dir data/arith --val-rows 64
    python tools/make_distill_student.py
    python bench/distillation.py --loss sampled_reverse_kl --steps 30
    python bench/distillation.py --loss top_k_forward_kl --steps 100
    python bench/distillation.py --loss full_reverse_kl --steps 100
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

CONFIG = "configs/examples/smollm2_distill.yaml"
PHASES = ("gen", "old_log_prob", "teacher", "update_actor", "sync")
LOSS_TERMS = ("top_k_forward_kl", "full_reverse_kl")  # a loss term of the update, logged as distillation/<loss>
WINDOW = 5  # steps averaged at each end: single steps of 32 samples swing


def run(config: str, overrides: list[str], run_dir: Path) -> dict:
    done = train(config, overrides, run_dir)
    steps, validation = done.steps, done.validation
    step_times = [r["timing_s/step"] for r in steps]

    def mean(key: str, part: list[dict]) -> float:
        return round(statistics.fmean(r[key] for r in part), 4)

    return {
        "overrides": overrides,
        "steps": len(steps),
        "reverse_kl_per_token_first": mean("distillation/reverse_kl_per_token", steps[:WINDOW]),
        "reverse_kl_per_token_last": mean("distillation/reverse_kl_per_token", steps[-WINDOW:]),
        "reverse_kl_per_token_by_step": [round(r["distillation/reverse_kl_per_token"], 4) for r in steps],
        **{f"{term}_{end}": mean(f"distillation/{term}", part)
           for term in LOSS_TERMS if f"distillation/{term}" in steps[0]
           for end, part in (("first", steps[:WINDOW]), ("last", steps[-WINDOW:]))},
        "val_greedy_before": validation[0]["val/score/mean"], "val_greedy_after": validation[-1]["val/score/mean"],
        "reward_first": mean("critic/score/mean", steps[:WINDOW]),
        "reward_last": mean("critic/score/mean", steps[-WINDOW:]),
        "entropy_first": mean("actor/entropy", steps[:WINDOW]), "entropy_last": mean("actor/entropy", steps[-WINDOW:]),
        "median_step_s": round(statistics.median(step_times), 2),
        "phase_share": done.phase_share(PHASES),
        "max_probe_gap": max(r["reshard/probe_max_abs_gap"] for r in steps),
        "wall_s": done.wall_s,
    }


def _config_lr(config: str) -> float:
    from hybridrl.config.loader import load_config

    return float(load_config(ROOT / config).actor_rollout_ref.actor.optim.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--loss", choices=("sampled_reverse_kl", *LOSS_TERMS), default="sampled_reverse_kl")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=None, help="actor lr (default: the config's)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/distillation.json")
    args = parser.parse_args()
    overrides = [f"trainer.total_training_steps={args.steps}", f"trainer.test_freq={args.steps}",
                 f"algorithm.distillation.loss={args.loss}"]
    if args.lr is not None:
        overrides.append(f"actor_rollout_ref.actor.optim.lr={args.lr}")
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.config, overrides, Path(tmp) / "run")
    result["config"] = args.config
    result["lr"] = args.lr if args.lr is not None else _config_lr(args.config)
    print(f"reverse KL per token: {result['reverse_kl_per_token_first']:.3f} (steps 1-{WINDOW}) -> "
          f"{result['reverse_kl_per_token_last']:.3f} (last {WINDOW})")
    print(f"greedy validation: {result['val_greedy_before']:.3f} before -> {result['val_greedy_after']:.3f} after")
    print(f"sampled reward (logged, not trained on): {result['reward_first']:.3f} -> {result['reward_last']:.3f}")
    print(f"median step {result['median_step_s']} s; shares {result['phase_share']}; wall {result['wall_s']} s")
    for term in LOSS_TERMS:
        if f"{term}_first" in result:
            print(f"{term}: {result[f'{term}_first']:.3f} -> {result[f'{term}_last']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs = json.loads(args.out.read_text()) if args.out.is_file() else {}
    runs[args.loss] = result
    args.out.write_text(json.dumps(runs, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
