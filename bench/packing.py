"""Sequence packing and balanced DP dispatch on a ragged batch: update and log-prob tokens/s.

The project's own megatron actor (`MegatronBackend` + `MegatronActor`: `compute_log_prob`,
`update_policy`) on forked gloo ranks at DP2, one torch thread each, on a tiny Llama with random
weights, fed a GRPO-shaped batch whose response lengths are long-tailed (lognormal: most short, a
few near `--max-response`; the longest is >= 8x the shortest). Modes:

* `padded`: `use_remove_padding=false`, fixed micro-batches of `--micro` rows (each trimmed to its
  longest row), the plain DP split (rows in batch order);
* `packed`: the same micro-batches packed into THD sequences (`use_remove_padding=true`);
* `packed_balanced`: packed, rows dispatched in `balanced_dp_order` (what `trainer.balance_batch`
  does in `WorkerGroup.call_by_dp`);
* `packed_balanced_dynamic`: that, with micro-batches by token budget (`use_dynamic_bsz`,
  `ppo_max_token_len_per_gpu=--max-tokens`).

Tokens/s counts the batch's real tokens (prompt + response) over the slowest rank's wall time of
one pass (median of `--repeats` after a warm-up, then the median over `--rounds` rounds that run
the modes in turn, so a change in the machine's load reaches every mode); CPU-s is the ranks'
process time summed (what other load on shared cores inflates least; a rank waiting for a slower
one in a collective spends wall time, not CPU time, so it does not show the balance); padding
ratio = padding columns / computed columns of the pass's micro-batches (`perf/padding_ratio`); DP
imbalance = heaviest rank's real tokens / the mean (`perf/dp_token_imbalance`). Prints a table and
writes `bench/results/packing.json`.

    python bench/packing.py [--rows 64] [--max-response 512] [--repeats 2] [--rounds 2]

Figures, not a test: cores may be shared; the machine's load is printed first.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from update_profile import batch_of_lengths  # noqa: E402  (bench/ is on the path when run as a script)

RESULTS = ROOT / "bench" / "results" / "packing.json"
MODES = ("padded", "packed", "packed_balanced", "packed_balanced_dynamic")
MODEL = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 2048}
TOY_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "vocab_size": 256}


def write_model(folder: Path, shape: dict[str, int], max_positions: int, seed: int = 0) -> Path:
    """A randomly initialized Llama saved as an HF folder (fp32 safetensors)."""
    import transformers

    config = transformers.LlamaConfig(**shape, max_position_embeddings=max_positions, tie_word_embeddings=False,
                                      rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def response_lengths(rows: int, max_response: int, *, median: int, sigma: float, long_rows: int,
                     seed: int) -> np.ndarray:
    """Long-tailed lengths: lognormal around `median`, clipped to [max_response / 64, max_response],
    with `long_rows` rows at 90-100 % of the maximum, at seeded random positions."""
    rng = np.random.default_rng(seed)
    shortest = max(1, max_response // 64)
    lengths = np.clip(np.rint(rng.lognormal(np.log(median), sigma, rows)), shortest, max_response).astype(np.int64)
    lengths[rng.choice(rows, size=long_rows, replace=False)] = rng.integers(
        int(0.9 * max_response), max_response + 1, long_rows)
    lengths[np.argmin(lengths)] = shortest  # the spread the case promises, whatever the draw
    return lengths


def ragged_batch(rows: int, vocab: int, *, max_prompt: int, max_response: int, median: int, sigma: float,
                 long_rows: int, seed: int = 0) -> Any:
    """Rows `[left-padded prompt | right-padded response]` as the rollout writes them, with advantages."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(max(1, max_prompt // 2), max_prompt + 1, (rows,), generator=gen)
    responses_len = response_lengths(rows, max_response, median=median, sigma=sigma, long_rows=long_rows, seed=seed)
    return batch_of_lengths(prompt_lengths, torch.as_tensor(responses_len), vocab, max_prompt=max_prompt,
                            max_response=max_response, gen=gen, meta={"temperature": 1.0})


def job_config(model: str, mode: str, *, dp: int, rows: int, micro: int, max_prompt: int, max_response: int,
               max_tokens: int) -> Any:
    from hybridrl.config.schema import JobConfig

    c = JobConfig()
    c.trainer.device = "cpu"
    c.trainer.nnodes, c.trainer.n_gpus_per_node = 1, dp
    c.trainer.torch_threads_per_rank = 1
    c.trainer.balance_batch = "balanced" in mode
    c.actor_rollout_ref.model.path = model
    c.actor_rollout_ref.model.use_remove_padding = mode != "padded"
    c.data.max_prompt_length, c.data.max_response_length = max_prompt, max_response
    c.data.train_batch_size = rows // 8
    c.actor_rollout_ref.rollout.n = 8
    a = c.actor_rollout_ref.actor
    a.megatron.use_distributed_optimizer = False
    a.megatron.dtype = "fp32"
    a.ppo_mini_batch_size = rows // 8  # one optimizer step per update, as GRPO on fresh samples
    a.ppo_micro_batch_size_per_gpu = micro
    a.use_dynamic_bsz = mode.endswith("dynamic")
    a.ppo_max_token_len_per_gpu = max_tokens
    a.optim.lr = 1e-6
    c.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = micro
    return c


def dispatch_order(batch: Any, mode: str, dp: int) -> np.ndarray | None:
    """The rows' dispatch order, as `WorkerGroup.call_by_dp` forms it (None: the plain split)."""
    from hybridrl.controller.dispatch import balanced_dp_order, row_tokens

    return balanced_dp_order(row_tokens(batch), dp, 1) if "balanced" in mode else None


def _rank(rank: int, world: int, config: Any, batch: Any, order: np.ndarray | None, repeats: int) -> dict[str, Any]:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    torch.set_num_threads(1)
    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    actor = MegatronActor(backend, plan)
    ctx = backend.ctx
    chunk = (batch if order is None else batch.reorder(order)).split(ctx.dp)[ctx.dp_rank]

    cpu: list[float] = []

    def timed(fn: Any) -> tuple[float, Any]:
        torch.distributed.barrier()
        started, cpu_started = time.perf_counter(), time.process_time()
        out = fn(chunk)
        cpu.append(time.process_time() - cpu_started)
        return time.perf_counter() - started, out

    timed(actor.compute_log_prob)  # warm-up: allocations, first-call paths
    timed(actor.update_policy)
    result: dict[str, Any] = {"dp": ctx.dp_rank, "rows": len(chunk),
                              "chunk_tokens": int(chunk.tensors["attention_mask"].sum()),
                              "log_prob_s": [], "update_s": [], "log_prob_cpu_s": [], "update_cpu_s": []}
    for _ in range(repeats):
        wall, out = timed(actor.compute_log_prob)
        result["log_prob_s"].append(wall)
        result["log_prob_cpu_s"].append(cpu[-1])
        result["log_prob_padding_ratio"] = out.meta["padding_ratio"]
        result["log_prob_tokens"] = (backend.tokens_seen.real, backend.tokens_seen.computed)
        wall, metrics = timed(actor.update_policy)
        result["update_s"].append(wall)
        result["update_cpu_s"].append(cpu[-1])
        result["update_padding_ratio"] = metrics.padding_ratio
        result["update_tokens"] = (backend.tokens_seen.real, backend.tokens_seen.computed)
    return result


def summarize(mode: str, rounds: list[list[dict[str, Any]]], tokens: int, imbalance: float) -> dict[str, Any]:
    """One row of the table from each round's ranks' results: per round, the median over repeats of
    the slowest rank's wall (and of the ranks' CPU seconds summed); then the median over rounds."""
    results = rounds[-1]
    row: dict[str, Any] = {"mode": mode, "tokens": tokens, "dp_token_imbalance": imbalance}
    for name in ("update", "log_prob"):
        walls, cpus = [], []
        for ranks in rounds:
            repeats = range(len(ranks[0][f"{name}_s"]))
            walls.append(statistics.median(max(r[f"{name}_s"][i] for r in ranks) for i in repeats))
            cpus.append(statistics.median(sum(r[f"{name}_cpu_s"][i] for r in ranks) for i in repeats))
        wall = statistics.median(walls)
        real = sum(r[f"{name}_tokens"][0] for r in results)
        computed = sum(r[f"{name}_tokens"][1] for r in results)
        row[f"{name}_s"] = wall
        row[f"{name}_s_by_round"] = walls
        row[f"{name}_cpu_s"] = statistics.median(cpus)
        row[f"{name}_tokens_per_s"] = tokens / wall
        row[f"{name}_real_tokens"] = real
        row[f"{name}_computed_tokens"] = computed
        row[f"{name}_padding_ratio"] = results[0][f"{name}_padding_ratio"]
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hybridrl.controller.dispatch import dp_token_imbalance, row_tokens
    from tests.support.forked import run_ranks

    shape = TOY_MODEL if args.toy else MODEL
    workdir = Path(tempfile.mkdtemp(prefix="bench_packing_"))
    model = str(write_model(workdir / "model", shape, args.max_prompt + args.max_response))
    batch = ragged_batch(args.rows, shape["vocab_size"], max_prompt=args.max_prompt, max_response=args.max_response,
                         median=args.median, sigma=args.sigma, long_rows=args.long_rows, seed=args.seed)
    lengths = batch.tensors["response_mask"].sum(-1)
    tokens = int(batch.tensors["attention_mask"].sum())
    load = os.getloadavg()
    report: dict[str, Any] = {
        "load_avg_before": load, "cores": os.cpu_count(), "model": shape, "rows": args.rows, "dp": args.dp,
        "micro": args.micro, "max_tokens": args.max_tokens, "tokens": tokens,
        "response_lengths": {"min": int(lengths.min()), "median": float(lengths.median()),
                             "mean": float(lengths.float().mean()), "max": int(lengths.max())},
        "padded_width": args.max_prompt + args.max_response, "modes": [],
    }
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    runs: dict[str, list[list[dict[str, Any]]]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):  # modes interleaved, so that a change in the machine's load hits them all
        for mode in modes:
            config = job_config(model, mode, dp=args.dp, rows=args.rows, micro=args.micro,
                                max_prompt=args.max_prompt, max_response=args.max_response, max_tokens=args.max_tokens)
            runs[mode].append(run_ranks(_rank, args.dp, config, batch, dispatch_order(batch, mode, args.dp),
                                        args.repeats, timeout_s=3600))
    for mode in modes:
        order = dispatch_order(batch, mode, args.dp)
        row = summarize(mode, runs[mode], tokens, dp_token_imbalance(row_tokens(batch), args.dp, 1, order))
        row["ranks"] = runs[mode][-1]
        report["modes"].append(row)
    report["load_avg_after"] = os.getloadavg()
    base = next((r for r in report["modes"] if r["mode"] == "padded"), None)
    for row in report["modes"]:
        for name in ("update", "log_prob"):
            row[f"{name}_speedup"] = (row[f"{name}_tokens_per_s"] / base[f"{name}_tokens_per_s"]) if base else None
    return report


def table(report: dict[str, Any]) -> str:
    def speed(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    lines = ["| mode | update tokens/s | vs padded | update CPU-s | log-prob tokens/s | vs padded | padding ratio "
             "(update / log-prob) | DP imbalance |", "|---|---|---|---|---|---|---|---|"]
    for r in report["modes"]:
        lines.append(f"| {r['mode']} | {r['update_tokens_per_s']:.0f} | {speed(r['update_speedup'])} | "
                     f"{r['update_cpu_s']:.1f} | {r['log_prob_tokens_per_s']:.0f} | {speed(r['log_prob_speedup'])} | "
                     f"{100 * r['update_padding_ratio']:.1f} % / {100 * r['log_prob_padding_ratio']:.1f} % | "
                     f"{r['dp_token_imbalance']:.3f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="sequences (a multiple of 8 x dp)")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--micro", type=int, default=4, help="rows per micro-batch (fixed modes)")
    parser.add_argument("--max-tokens", type=int, default=2048, help="token budget per micro-batch (dynamic)")
    parser.add_argument("--max-prompt", type=int, default=32)
    parser.add_argument("--max-response", type=int, default=512)
    parser.add_argument("--median", type=int, default=32, help="median response length")
    parser.add_argument("--sigma", type=float, default=0.9, help="lognormal spread of the response lengths")
    parser.add_argument("--long-rows", type=int, default=3, help="rows at 90-100 %% of --max-response")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes of each kind per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the modes (interleaved)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--toy", action="store_true", help="a 2-layer width-64 model (tests)")
    parser.add_argument("--out", default=str(RESULTS))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.perf_counter()
    report = run(args)
    report["bench_s"] = time.perf_counter() - started
    report["command"] = "python bench/packing.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lengths = report["response_lengths"]
    print(f"load average {report['load_avg_before'][0]:.2f} (before) {report['load_avg_after'][0]:.2f} (after) "
          f"on {report['cores']} cores; {report['rows']} rows at DP{report['dp']}, {report['tokens']} real tokens, "
          f"responses {lengths['min']}-{lengths['max']} tokens (median {lengths['median']:.0f}, mean "
          f"{lengths['mean']:.1f}), padded width {report['padded_width']}")
    print(table(report))
    out = Path(report_path := args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {report_path} ({report['bench_s']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
