"""Asynchronous rollouts against the colocated hybrid engine, at equal CPU cores, in one run.

The same GRPO job three ways on the same 2 cores, through `hybridrl train`:
  colocated      2 ranks, each trains (DP2) and generates (2 vLLM replicas): generate, then train
  one_step_off   1 trainer rank + a rollout pool of 1 rank: step k+1 generates while step k trains
  fully_async    1 + 1: the pool generates continuously; max_staleness 1, partial rollouts
  fully_async_drain  fully_async without partial rollouts (requests in flight finish before a sync)
  fully_async_s2 the same with max_staleness 2 (three batches in flight)
on a task whose response lengths are long-tailed: the demo's tiny model (random weights) with answers
of up to `--max-response` tokens that end at its EOS, which it samples about once in 96 tokens, so
lengths are roughly geometric with a tail cut at the limit (printed: quantiles of the first step's
lengths). A synchronous step waits for its longest response; the async modes overlap that tail with
training.

Per mode: steps/s (the median step time after `--warmup` steps; the step time is the trainer's: wait
for samples + train + sync), the ratio to colocated, and the reward curve (the score per step), which
shows what the older samples cost in learning. The modes run one after the other, `--rounds` times in
turn, so all see the same machine load; figures go to bench/results/async.json.

    python bench/async.py [--steps 24] [--warmup 4] [--max-response 128] [--rounds 1] [--modes ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.demo_assets import build_demo_assets, demo_overrides  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "async.json"
CONFIG = "configs/examples/cpu_tiny_grpo.yaml"
MODES = {
    "colocated": ["trainer.n_gpus_per_node=2"],
    "one_step_off": ["trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.mode=disaggregated",
                     "actor_rollout_ref.rollout.n_gpus_per_node=1",
                     "actor_rollout_ref.rollout.async_mode=one_step_off"],
    "fully_async": ["trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.mode=disaggregated",
                    "actor_rollout_ref.rollout.n_gpus_per_node=1",
                    "actor_rollout_ref.rollout.async_mode=fully_async", "actor_rollout_ref.rollout.max_staleness=1"],
    # no partial rollouts: a sync lets the requests in flight finish on the old weights (no re-prefill)
    "fully_async_drain": ["trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.mode=disaggregated",
                          "actor_rollout_ref.rollout.n_gpus_per_node=1",
                          "actor_rollout_ref.rollout.async_mode=fully_async",
                          "actor_rollout_ref.rollout.max_staleness=1",
                          "actor_rollout_ref.rollout.partial_rollout=false"],
    # more in flight: vLLM's step costs about the same with more sequences on this model, so a deeper
    # buffer is more throughput for one more version of staleness
    "fully_async_s2": ["trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.mode=disaggregated",
                       "actor_rollout_ref.rollout.n_gpus_per_node=1",
                       "actor_rollout_ref.rollout.async_mode=fully_async", "actor_rollout_ref.rollout.max_staleness=2"],
}


def run_mode(assets: Path, out: Path, mode: str, args: argparse.Namespace) -> dict:
    run = out / mode
    overrides = demo_overrides(
        assets, run, f"trainer.total_training_steps={args.steps}", f"data.max_response_length={args.max_response}",
        f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        "actor_rollout_ref.actor.optim.lr=2e-3", "trainer.torch_threads_per_rank=1", *MODES[mode])
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", CONFIG, *overrides, "--no-progress"],
                            cwd=ROOT, capture_output=True, text=True, env={**os.environ})
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing_s/step" in r]
    times = [r["timing_s/step"] for r in rows[args.warmup:]]
    lengths = sorted(r["response_length/mean"] for r in rows[:1])
    return {
        "mode": mode, "wall_s": wall, "step_s_median": statistics.median(times),
        "steps_per_s": 1 / statistics.median(times),
        "scores": [r["critic/score/mean"] for r in rows],
        "response_length_max_first": rows[0].get("response_length/max"), "response_length_mean_first": lengths[0],
        "staleness_mean": statistics.mean(r.get("async/staleness_mean", 0.0) for r in rows),
        "partial_fraction": statistics.mean(r.get("async/partial_sample_fraction", 0.0) for r in rows),
        "phases": {k.removeprefix("timing_s/"): statistics.median(r.get(k, 0.0) for r in rows[args.warmup:])
                   for k in ("timing_s/wait_rollout", "timing_s/gen", "timing_s/update_actor", "timing_s/sync")},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-response", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_async")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    assets = build_demo_assets(args.out / "assets")
    load_start = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for round_ in range(args.rounds):
        for mode in modes:
            print(f"round {round_ + 1}/{args.rounds}: {mode} ...", flush=True)
            runs[mode].append(run_mode(assets, args.out / f"r{round_}", mode, args))
    summary = {}
    base = statistics.median(r["steps_per_s"] for r in runs["colocated"]) if "colocated" in runs else None
    # per round, each mode against the colocated run of the same round (the load it saw is the closest)
    per_round = {m: [r["steps_per_s"] / c["steps_per_s"] for r, c in zip(results, runs["colocated"])]
                 for m, results in runs.items()} if base else {}
    print(f"\n{'mode':<14}{'step s':>8}{'steps/s':>9}{'vs colocated':>14}{'staleness':>11}{'partial':>9}"
          f"{'  score first4 -> last4'}")
    for mode, results in runs.items():
        steps_per_s = statistics.median(r["steps_per_s"] for r in results)
        scores = results[0]["scores"]
        first, last = statistics.mean(scores[:4]), statistics.mean(scores[-4:])
        ratio = steps_per_s / base if base else float("nan")
        summary[mode] = {"steps_per_s": steps_per_s, "vs_colocated": ratio, "score_first4": first, "score_last4": last,
                         "vs_colocated_by_round": per_round.get(mode), "runs": results}
        print(f"{mode:<14}{1 / steps_per_s:>8.2f}{steps_per_s:>9.3f}{ratio:>13.2f}x"
              f"{results[0]['staleness_mean']:>11.2f}{results[0]['partial_fraction']:>9.2f}"
              f"  {first:.3f} -> {last:.3f}")
    for mode, ratios in per_round.items():
        print(f"{mode} vs colocated, by round: " + ", ".join(f"{r:.2f}x" for r in ratios))
    for mode, results in runs.items():
        print(f"{mode} scores: " + " ".join(f"{s:.2f}" for s in results[0]["scores"]))
        print(f"{mode} median phases (s): " + ", ".join(f"{k} {v:.2f}" for k, v in results[0]["phases"].items()))
    first = next(iter(runs.values()))[0]
    print(f"first step's response length: mean {first['response_length_mean_first']:.1f}, "
          f"max {first['response_length_max_first']}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (start: {load_start:.1f})")
    report = {"command": "python bench/async.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "load_avg": [load_start, os.getloadavg()[0]],
              "args": {k: str(v) for k, v in vars(args).items()}, "summary": summary}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
