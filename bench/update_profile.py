"""Where the actor update's time goes on a real model: the project's own megatron actor (`MegatronBackend`
+ `MegatronActor.update_policy`) on forked gloo ranks, one torch thread each, on a GRPO-shaped batch.

The batch is what the trainer hands the update: `--rows` sequences in groups of `--group` sampled
from one prompt (GRPO's n), prompts left-padded to `--max-prompt` (real lengths uniform around
`--prompt`), responses right-padded to `--max-response` (real lengths uniform around `--response`),
one mini-batch (one optimizer step, on-policy: the update's own forward is the old policy),
micro-batches of `--micro` rows per rank. `--modes` runs the update on padded micro-batches, packed
ones (`model.use_remove_padding`) and packed ones holding each group's prompt once
(`model.shared_prefix`), one after the other on each layout.

Prints, per layout (`--layouts pp2,dp2`) and mode: the median update wall time over `--repeats` updates,
real tokens/s, the CPU seconds of all ranks, and the matmul-FLOP bound: the update's matmul FLOPs
(bench/bounds.py's count over the real tokens of every row, and with `shared` also the count with each
group's prompt once) at the single-core GEMM rate each rank measures on its
own matmul route (per CPU-second, so that other load on shared cores does not deflate it), spread
over the ranks' cores. The update's multiple of it is given by wall time and by CPU time (the
latter is what to compare on a loaded machine). Then, from one more update under torch.profiler,
each rank's self-CPU time by category (matmuls split into the vocab head and the rest, log-softmax/
entropy math, pipeline receive waits, grad reduce, optimizer, copies) and the top aten ops.

    python bench/update_profile.py [--model data/models/smollm2-135m-instruct] [--layouts pp2,dp2]

Figures, not a test: cores are shared; compare shares and ratios measured within one run, and read
the machine's load printed first.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
RESULTS = ROOT / "bench" / "results" / "update_profile.json"
# name: (tp, pp, dp, layers on the first stage: None = even). The uneven ones move layers off the
# last stage, which also holds the vocab head (SmolLM2-135M: 30 layers, 15 + 15 even).
# With shared prompts the layers' share of the update falls and the head's (response tokens only) does
# not, so the balanced split moves further off the last stage.
LAYOUTS = {"pp2": (1, 2, 1, None), "dp2": (1, 1, 2, None), "pp1": (1, 1, 1, None),
           "pp2-16+14": (1, 2, 1, 16), "pp2-17+13": (1, 2, 1, 17), "pp2-18+12": (1, 2, 1, 18),
           "pp2-19+11": (1, 2, 1, 19), "pp2-21+9": (1, 2, 1, 21)}


def grpo_batch(rows: int, vocab: int, *, prompt: int, max_prompt: int, response: int, max_response: int,
               seed: int = 0, group: int = 1) -> Any:
    """Rows `[left-padded prompt | right-padded response]` as the rollout writes them, with advantages;
    each `group` consecutive rows sampled from one prompt."""
    gen = torch.Generator().manual_seed(seed)
    spread_p, spread_r = max(1, prompt // 5), max(1, response // 3)
    prompt_lengths = torch.randint(prompt - spread_p, prompt + spread_p + 1, (rows,), generator=gen)
    prompt_lengths = prompt_lengths[torch.arange(rows) // group * group]  # a group's rows: its first row's
    response_lengths = torch.randint(response - spread_r, response + spread_r + 1, (rows,), generator=gen)
    return batch_of_lengths(prompt_lengths.clamp(1, max_prompt), response_lengths.clamp(1, max_response), vocab,
                            max_prompt=max_prompt, max_response=max_response, gen=gen, group=group)


def batch_of_lengths(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, vocab: int, *, max_prompt: int,
                     max_response: int, gen: torch.Generator, meta: dict[str, Any] | None = None,
                     group: int = 1) -> Any:
    """A GRPO batch of random tokens with these prompt and response lengths, laid out as the rollout
    writes rows (`[left-padded prompt | right-padded response]`), groups of 8 rows (uid), one advantage
    each; each `group` consecutive rows share their first row's prompt tokens."""
    from hybridrl.data.batch import Batch

    rows = len(prompt_lengths)
    prompts = torch.zeros(rows, max_prompt, dtype=torch.long)
    responses = torch.zeros(rows, max_response, dtype=torch.long)
    prompt_mask = torch.zeros(rows, max_prompt, dtype=torch.long)
    response_mask = torch.zeros(rows, max_response, dtype=torch.long)
    for i in range(rows):
        p, r = int(prompt_lengths[i]), int(response_lengths[i])
        prompts[i, max_prompt - p:] = torch.randint(3, vocab, (p,), generator=gen)
        if i % group:
            prompts[i] = prompts[i - i % group]
        prompt_mask[i, max_prompt - p:] = 1
        responses[i, :r] = torch.randint(3, vocab, (r,), generator=gen)
        response_mask[i, :r] = 1
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    response_positions = positions[:, -1:] + 1 + torch.arange(max_response).unsqueeze(0)
    # GRPO: one advantage per sequence (group-normalized scores), spread over its response tokens
    advantages = torch.randn(rows, 1, generator=gen) * response_mask
    return Batch({
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": torch.cat([prompt_mask, response_mask], 1),
        "position_ids": torch.cat([positions, response_positions], 1),
        "responses": responses, "response_mask": response_mask, "advantages": advantages,
    }, {"uid": [i // 8 for i in range(rows)]}, meta or {})


MODES = ("padded", "packed", "shared")  # micro-batches: padded rows, packed rows, packed with shared prompts


def job_config(model: str, *, tp: int, pp: int, dp: int, rows: int, micro: int, max_prompt: int,
               max_response: int, mode: str = "padded") -> Any:
    from hybridrl.config.schema import JobConfig

    c = JobConfig()
    c.trainer.device = "cpu"
    c.trainer.nnodes, c.trainer.n_gpus_per_node = 1, tp * pp * dp
    c.trainer.torch_threads_per_rank = 1
    c.actor_rollout_ref.model.path = model
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {MODES}")
    c.actor_rollout_ref.model.use_remove_padding = mode != "padded"
    c.actor_rollout_ref.model.shared_prefix = mode == "shared"
    c.data.max_prompt_length, c.data.max_response_length = max_prompt, max_response
    c.data.train_batch_size = rows // 8
    c.actor_rollout_ref.rollout.n = 8
    a = c.actor_rollout_ref.actor
    a.megatron.tensor_model_parallel_size, a.megatron.pipeline_model_parallel_size = tp, pp
    a.megatron.use_distributed_optimizer = False
    a.megatron.dtype = "fp32"
    a.ppo_mini_batch_size = rows // 8  # one optimizer step per update, as the GRPO demo
    a.ppo_micro_batch_size_per_gpu = micro
    a.optim.lr = 1e-6
    c.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = micro
    return c


# Self-CPU time of aten ops by what they are for (first matching category wins).
CATEGORIES = (
    ("pp_recv_wait", ("recv", "send", "irecv", "isend", "batch_isend_irecv", "wait")),
    ("grad_reduce", ("allreduce", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear")),
    ("softmax_exp_log", ("softmax", "aten::exp", "aten::log", "logsumexp", "aten::max", "aten::amax")),
    ("optimizer", ("_foreach", "adam", "lerp", "addcmul", "addcdiv", "sqrt")),
    ("copy_cast", ("aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::cat",
                   "aten::gather", "aten::scatter", "aten::index", "aten::masked_fill", "aten::fill_",
                   "aten::zero_", "aten::zeros", "aten::empty")),
    ("elementwise", ("aten::mul", "aten::add", "aten::sub", "aten::div", "aten::where", "aten::sum",
                     "aten::mean", "aten::silu", "aten::rsqrt", "aten::pow", "aten::neg", "aten::clamp",
                     "aten::sigmoid", "aten::cos", "aten::sin")),
)


def categorize(events: list[tuple[str, str, float]], vocab_dims: tuple[int, ...]) -> dict[str, float]:
    """Seconds by category from (op name, input shapes, self-CPU us); matmuls touching a vocab-sized
    dimension are the vocab head (logits forward, their input and weight gradients)."""
    out: dict[str, float] = defaultdict(float)
    for name, shapes, us in events:
        low = name.lower()
        category = "other"
        for cat, keys in CATEGORIES:
            if any(k.lower() in low for k in keys):
                category = cat
                break
        if category == "matmul":
            category = "matmul_vocab_head" if any(str(v) in shapes for v in vocab_dims) else "matmul_layers"
        out[category] += us / 1e6
    return dict(out)


def cpu_gemm_rate(rows: int, hidden: int, intermediate: int) -> float:
    """fp32 FLOP/s of the update's own matmul route ([rows, hidden] x [hidden, intermediate], this
    process's torch settings, one thread), per CPU-second: time-slicing by other processes on shared
    cores stretches wall time, not CPU time, so this rate and the ranks' CPU seconds stay comparable."""
    a, b = torch.randn(rows, hidden), torch.randn(intermediate, hidden)
    torch.nn.functional.linear(a, b)
    iters = max(3, int(4e9 / (2 * rows * hidden * intermediate)))
    started = time.process_time()
    for _ in range(iters):
        torch.nn.functional.linear(a, b)
    return 2 * rows * hidden * intermediate * iters / (time.process_time() - started)


def _rank(rank: int, world: int, config: Any, batch: Any, repeats: int, profile: bool,
          gemm_rows: int) -> dict[str, Any]:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    torch.set_num_threads(1)
    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    actor = MegatronActor(backend, plan)
    ctx = backend.ctx
    chunk = batch.split(ctx.dp)[ctx.dp_rank]
    padded_vocab = int(backend.chunks[-1].vocab_size) if hasattr(backend.chunks[-1], "vocab_size") else 0

    # the optimizer's share, timed directly (it runs once per update, outside the schedule)
    opt_seconds: list[float] = []
    step = backend.optimizer.step

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return step(*args, **kwargs)
        finally:
            opt_seconds.append(time.perf_counter() - started)

    backend.optimizer.step = timed_step
    actor.update_policy(chunk)  # warm-up: allocations, first-call paths
    gemm = cpu_gemm_rate(gemm_rows, backend.config.hidden_size, backend.config.ffn_hidden_size)
    walls, cpus = [], []
    for _ in range(repeats):
        torch.distributed.barrier()
        started, cpu0 = time.perf_counter(), time.process_time()
        actor.update_policy(chunk)
        walls.append(time.perf_counter() - started)
        cpus.append(time.process_time() - cpu0)
    result: dict[str, Any] = {"coords": {"tp": ctx.tp_rank, "pp": ctx.pp_rank, "dp": ctx.dp_rank},
                              "wall_s": walls, "cpu_s": cpus, "optimizer_s": opt_seconds[1:],
                              "gemm_flops_per_cpu_s": gemm, "threads": torch.get_num_threads()}
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        torch.distributed.barrier()
        with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            started = time.perf_counter()
            actor.update_policy(chunk)
            result["profiled_wall_s"] = time.perf_counter() - started
        events = [(e.key, str(e.input_shapes), e.self_cpu_time_total)
                  for e in prof.key_averages(group_by_input_shape=True)]
        vocab = int(backend.vocab_size)
        dims = tuple({vocab, padded_vocab, -(-vocab // 128) * 128} - {0})
        result["categories_s"] = categorize(events, dims)
        by_name: dict[str, float] = defaultdict(float)
        for name, _, us in events:
            by_name[name] += us / 1e6
        result["top_ops_s"] = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
        result["top_op_shapes_s"] = [(name, shapes, us / 1e6) for name, shapes, us in
                                     sorted(events, key=lambda e: -e[2])[:16]]
    return result


def update_flops(model: str, batch: Any, prompt_group: int = 1) -> float:
    """The update's matmul FLOPs over all its real tokens (bench/bounds.py's count: forward + backward,
    causal attention's half of each s x s product), whatever the layout; `prompt_group`: each group's
    prompt counted once (shared prompts)."""
    from bounds import step_bound

    config = json.loads((Path(model) / "config.json").read_text())
    real = batch.tensors["attention_mask"].sum(-1).float()
    rows = real.numel()
    response = float(batch.tensors["response_mask"].sum()) / rows
    prompt = float(real.mean()) - response
    unit = {"train_flops_per_s": 1.0, "decode_flops_per_s": 1.0, "copy_bytes_per_s": 1.0}
    return step_bound(config, dtype="fp32", sequences=rows, prompt_tokens=prompt,
                      response_tokens=max(1, round(response)), ranks=1, rates=unit,
                      prompt_group=prompt_group)["bound_s/update"]


def run_with_worker_env() -> None:
    """Re-run this process with the CPU workers' environment (`DevicePolicy.worker_env`: the allocator
    settings the trainer's workers start with) when it is missing, so the forked ranks measure what
    the workers do."""
    from hybridrl.parallel.device_policy import CPU

    missing = {name: value for name, value in CPU.worker_env if name not in os.environ}
    if missing:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **missing})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/smollm2-135m-instruct")
    parser.add_argument("--layouts", default="pp2,dp2")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=40)
    parser.add_argument("--max-prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=50)
    parser.add_argument("--max-response", type=int, default=64)
    parser.add_argument("--group", type=int, default=8, help="rows sampled from one prompt (GRPO's n)")
    parser.add_argument("--modes", default="padded,packed,shared", help=f"micro-batch modes, of {','.join(MODES)}")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--tag", default="", help="a label stored with the results (e.g. before/after)")
    args = parser.parse_args()
    run_with_worker_env()
    from tests.support.forked import run_ranks

    model = str((ROOT / args.model) if not Path(args.model).is_absolute() else Path(args.model))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    batch = grpo_batch(args.rows, vocab, prompt=args.prompt, max_prompt=args.max_prompt, response=args.response,
                       max_response=args.max_response, group=args.group)
    tokens = int(batch.tensors["attention_mask"].sum())
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores; "
          f"{args.rows} rows, {tokens} real tokens ({tokens / args.rows:.1f}/row, "
          f"{int(batch.tensors['response_mask'].sum()) / args.rows:.1f} response), padded width "
          f"{args.max_prompt + args.max_response}, groups of {args.group} rows sharing a prompt")
    report: dict[str, Any] = {"tag": args.tag, "load_avg": load, "rows": args.rows, "tokens": tokens,
                              "micro": args.micro, "group": args.group, "layouts": {}}
    runs = [(name, mode) for name in args.layouts.split(",") for mode in args.modes.split(",")]
    for name, mode in runs:
        tp, pp, dp, first = LAYOUTS[name]
        config = job_config(model, tp=tp, pp=pp, dp=dp, rows=args.rows, micro=args.micro,
                            max_prompt=args.max_prompt, max_response=args.max_response, mode=mode)
        config.actor_rollout_ref.actor.megatron.num_layers_in_first_pipeline_stage = first
        started = time.perf_counter()
        world = tp * pp * dp
        gemm_rows = args.micro * (tokens // args.rows)
        results = run_ranks(_rank, world, config, batch, args.repeats, not args.no_profile, gemm_rows,
                            timeout_s=3600)
        wall = statistics.median(max(r["wall_s"][i] for r in results) for i in range(args.repeats))
        cpu = statistics.median(sum(r["cpu_s"][i] for r in results) for i in range(args.repeats))
        rate = statistics.median(r["gemm_flops_per_cpu_s"] for r in results)
        flops = update_flops(model, batch)
        # the bound: every matmul FLOP at this machine's single-core GEMM rate, the work spread over
        # the `world` cores the ranks have; wall time on shared cores is inflated by other load, CPU
        # time much less, so both ratios are printed. With shared prompts also the bound of the
        # arithmetic left (each group's prompt once).
        bound = flops / rate / world
        shared_bound = update_flops(model, batch, args.group) / rate / world if mode == "shared" else bound
        entry = {"mode": mode, "update_s": wall, "tokens_per_s": tokens / wall, "cpu_s_all_ranks": cpu,
                 "flops": flops, "gemm_gflops_per_cpu_s": rate / 1e9, "bound_s": bound, "x_bound_wall": wall / bound,
                 "x_bound_cpu": cpu / (bound * world), "shared_bound_s": shared_bound,
                 "x_shared_bound_wall": wall / shared_bound, "x_shared_bound_cpu": cpu / (shared_bound * world),
                 "ranks": results, "total_s": time.perf_counter() - started}
        report["layouts"][f"{name}-{mode}"] = entry
        print(f"\n== {name} (tp{tp} pp{pp} dp{dp}) {mode}: update {wall:.2f} s wall (runs "
              f"{[round(max(r['wall_s'][i] for r in results), 2) for i in range(args.repeats)]}), "
              f"{tokens / wall:.0f} tokens/s, {cpu:.1f} CPU-s over the ranks; {flops / 1e12:.2f} TFLOP at "
              f"{rate / 1e9:.0f} GFLOP/CPU-s -> bound {bound:.2f} s on {world} cores: "
              f"{wall / bound:.2f}x bound (wall), {cpu / (bound * world):.2f}x (CPU time)"
              + (f"; with each prompt once: bound {shared_bound:.2f} s, {wall / shared_bound:.2f}x (wall), "
                 f"{cpu / (shared_bound * world):.2f}x (CPU time)" if mode == "shared" else ""))
        for r in results:
            c = r["coords"]
            optimizer = statistics.median(r["optimizer_s"] or [0.0])
            print(f"  rank pp{c['pp']} dp{c['dp']}: wall {statistics.median(r['wall_s']):.2f} s, cpu "
                  f"{statistics.median(r['cpu_s']):.2f} s, optimizer {optimizer:.2f} s, threads {r['threads']}")
            if "categories_s" in r:
                cats = sorted(r["categories_s"].items(), key=lambda kv: -kv[1])
                total = sum(v for _, v in cats)
                print(f"    profiled update {r['profiled_wall_s']:.2f} s; self-CPU by category: "
                      + ", ".join(f"{k} {v:.2f} ({100 * v / total:.0f}%)" for k, v in cats))
                print("    top ops: " + ", ".join(f"{k} {v:.2f}" for k, v in r["top_ops_s"]))
                print("    top ops by input shapes: " + "; ".join(
                    f"{k} {shapes} {v:.2f}" for k, shapes, v in r["top_op_shapes_s"]))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    previous[args.tag or "latest"] = report
    RESULTS.write_text(json.dumps(previous, indent=1, default=str))
    print(f"\nwrote {RESULTS.relative_to(ROOT)} [{args.tag or 'latest'}]")


if __name__ == "__main__":
    main()
