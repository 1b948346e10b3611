"""Lower bounds on a GRPO step's time on this machine: the arithmetic and memory traffic no
implementation can avoid, divided by rates measured here (one core per rank).

- update (forward + backward): 3 x (2 FLOPs per layer weight per token + causal attention's two
  s^2/2 matmuls + 2 FLOPs per lm_head weight per response token: the loss needs the logits of the
  response tokens only), at the GEMM rate measured at the update's shapes;
- generation: every decode step multiplies each running sequence through the weights (at the GEMM
  rate of an M = sequences matmul) and must read the weights once and every sequence's KV cache
  (at the measured copy bandwidth); a step costs the larger of the two. Prefill is counted as compute
  (the lm_head at the last prompt position only).

Embedding lookups, norms, activations, softmax, sampling and the optimizer count as free, and the
rates are peaks of single large operations, so the bound is below what any implementation reaches.
A step measured at k x the bound is within a factor k of the best this machine allows; hybridrl/TRL
cannot go below bound/TRL, whatever hybridrl does.

    python bench/bounds.py [--size 30m] [--dtype bf16]   # prints the rates and the bound of one step
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def body_params(config: dict[str, Any]) -> int:
    """Weights every token is multiplied by: the attention and MLP projections of every layer."""
    h, layers, d = config["hidden_size"], config["num_hidden_layers"], head_dim(config)
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    attn = h * heads * d + 2 * h * kv * d + heads * d * h
    mlp = 3 * h * config["intermediate_size"]
    return layers * (attn + mlp)


def head_params(config: dict[str, Any]) -> int:
    """The lm_head's weights (it multiplies even when tied to the embedding)."""
    return config["hidden_size"] * config["vocab_size"]


def matmul_params(config: dict[str, Any]) -> int:
    """Weights a token whose next-token logits are needed is multiplied by: the layers and the lm_head."""
    return body_params(config) + head_params(config)


def flops_per_token(config: dict[str, Any], seq: int, *, training: bool) -> float:
    """Model FLOPs per token of a seq-long sequence: 2 per matmul weight plus attention's QK^T and AV
    over the whole sequence (x3 with backward). The MFU convention: the causal half is not discounted."""
    attention = 2 * 2 * config["num_hidden_layers"] * seq * config["num_attention_heads"] * head_dim(config)
    forward = 2 * matmul_params(config) + attention
    return 3 * forward if training else forward


def _timed(fn: Any, iters: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - started) / iters


def _gemm_rate(rows: int, hidden: int, intermediate: int, dtype: torch.dtype) -> float:
    """The fastest FLOP/s of a [rows, hidden] x [hidden, intermediate] product this machine offers in
    `dtype`: torch's default route, torch's oneDNN route (fp32: where it stays fp32, see
    hybridrl.parallel.cpu.matmul), and vLLM's prepacked oneDNN GEMM when vLLM is installed."""
    from hybridrl.parallel.cpu.matmul import onednn_fp32_is_exact, onednn_matmul_setting

    a, b = torch.randn(rows, hidden, dtype=dtype), torch.randn(intermediate, hidden, dtype=dtype)
    iters = max(3, int(2e9 / (2 * rows * hidden * intermediate)))  # ~2 GFLOP per candidate
    candidates = [lambda: torch.nn.functional.linear(a, b)]
    try:
        import vllm._custom_ops as vllm_ops

        handler = vllm_ops.create_onednn_mm(b.t())
        candidates.append(lambda: vllm_ops.onednn_mm(handler, a, None))
    except Exception:  # vLLM absent or built without its CPU ops: torch's routes only
        pass
    seconds = [_timed(fn, iters) for fn in candidates]
    setting = onednn_matmul_setting()  # None before torch 2.9, where onednn_fp32_is_exact() is False
    if dtype == torch.float32 and onednn_fp32_is_exact():
        previous, setting.fp32_precision = setting.fp32_precision, "bf16"
        try:
            seconds.append(_timed(candidates[0], iters))
        finally:
            setting.fp32_precision = previous
    return 2 * rows * hidden * intermediate / min(seconds)


@functools.cache
def measured_rates(dtype: str, hidden: int, intermediate: int, decode_rows: int, train_rows: int) -> dict[str, float]:
    """One thread: the best GEMM FLOP/s at the update's shape ([train_rows, hidden] x [hidden, intermediate])
    and at a decode step's ([decode_rows, ...]), and copy bandwidth (bytes read + written per second)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dt = DTYPES[dtype]
        rates = {"train_flops_per_s": _gemm_rate(train_rows, hidden, intermediate, dt),
                 "decode_flops_per_s": _gemm_rate(decode_rows, hidden, intermediate, dt)}
        src = torch.ones(64 << 20, dtype=torch.float32)
        dst = torch.empty_like(src)
        rates["copy_bytes_per_s"] = 2 * src.numel() * 4 / _timed(lambda: dst.copy_(src), iters=5)
        return rates
    finally:
        torch.set_num_threads(previous)


def step_bound(config: dict[str, Any], *, dtype: str, sequences: int, prompt_tokens: float,
               response_tokens: int, ranks: int = 1, micro_batch: int = 16,
               rates: dict[str, float] | None = None, prompt_group: int = 1) -> dict[str, float]:
    """Lower bounds (seconds) of one GRPO step of `sequences` sequences (mean prompt length
    `prompt_tokens`, `response_tokens` generated each) over `ranks` data-parallel ranks of one core.
    `rates` (keys as `measured_rates`'): measured here when not given. `prompt_group`: rows whose update
    computes their prompt once (`model.shared_prefix`: a prompt's layers once per group, its self-attention
    once, each response attending to it); 1 = every row its own prompt."""
    value_bytes = 2 if dtype == "bf16" else 4
    seq = prompt_tokens + response_tokens
    per_rank = sequences / ranks
    rates = rates or measured_rates(dtype, config["hidden_size"], config["intermediate_size"],
                                    max(1, round(per_rank)), max(1, round(micro_batch * seq)))
    weights, body, head = matmul_params(config), body_params(config), head_params(config)
    layers, heads, d = config["num_hidden_layers"], config["num_attention_heads"], head_dim(config)

    # update: forward + backward; causal attention needs only the lower half of each s x s product (a
    # row: (P + R)^2 / 2 = P^2 / 2 + P R + R^2 / 2; with a shared prompt its P^2 / 2 once per group),
    # the loss only the response tokens' logits
    p, r = prompt_tokens, response_tokens
    attention = 2 * 2 * layers * heads * d * (p * p / 2 / prompt_group + p * r + r * r / 2)
    update_flops = 3 * per_rank * (2 * body * (p / prompt_group + r) + 2 * head * r + attention)
    update_s = update_flops / rates["train_flops_per_s"]

    # generation: prefill as compute, then one decode step per response token
    from hybridrl.config.estimates import kv_bytes_per_token
    from hybridrl.models.arch import ModelShape

    kv_token = kv_bytes_per_token(ModelShape.from_hf_config(config), value_bytes)
    prefill_s = per_rank * (2 * body * prompt_tokens + 2 * head) / rates["train_flops_per_s"]
    decode_s = 0.0
    for t in range(response_tokens):
        context = prompt_tokens + t
        flops = per_rank * (2 * weights + 2 * 2 * layers * heads * d * context)
        traffic = weights * value_bytes + per_rank * context * kv_token
        decode_s += max(flops / rates["decode_flops_per_s"], traffic / rates["copy_bytes_per_s"])
    gen_s = prefill_s + decode_s
    return {
        "bound_s/gen": gen_s, "bound_s/update": update_s, "bound_s/step": gen_s + update_s,
        "rate/train_gflops": rates["train_flops_per_s"] / 1e9, "rate/decode_gflops": rates["decode_flops_per_s"] / 1e9,
        "rate/copy_gb_per_s": rates["copy_bytes_per_s"] / 1e9,
    }


def bound_of_run(config_path: str, *, dtype: str, prompts: int, n: int, response_tokens: int, ranks: int,
                 micro_batch: int, tokens_per_step: float) -> dict[str, float]:
    """The bound of a benchmark's step: full-length responses, mean prompt length from its token count
    (`perf/total_num_tokens`: every real token of the step)."""
    sequences = prompts * n
    prompt_tokens = max(0.0, (tokens_per_step - sequences * response_tokens) / sequences)
    config = json.loads((ROOT / config_path).read_text())
    return step_bound(config, dtype=dtype, sequences=sequences, prompt_tokens=prompt_tokens,
                      response_tokens=response_tokens, ranks=ranks, micro_batch=micro_batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="30m", choices=("tiny", "30m"))
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--prompt", type=float, default=14.0, help="mean prompt tokens (the synthetic task: ~14)")
    parser.add_argument("--ranks", type=int, default=1)
    args = parser.parse_args()
    folder = "tiny-demo" if args.size == "tiny" else "bench-30m"
    config = json.loads((ROOT / "configs" / "models" / folder / "config.json").read_text())
    response = 16 if args.size == "tiny" else 128
    bound = step_bound(config, dtype=args.dtype, sequences=args.sequences, prompt_tokens=args.prompt,
                       response_tokens=response, ranks=args.ranks)
    for key, value in bound.items():
        print(f"{key:<24}{value:>10.3f}")


if __name__ == "__main__":
    main()
