"""Rollout throughput of the in-process vLLM engine on CPU, next to HF `generate` on the same model.

Builds a small random Llama (never downloaded), then measures: engine build time, generation
tokens/s for prompts x n samples (median of repeats, after a warm-up call), and the time of a weight
update through each path (HF names via vLLM's reload; vLLM shards written in place + CPU repack).
Figures, not a test: cores are shared and noisy, compare ratios within one run.

    python bench/rollout.py [--prompts 8] [--n 4] [--max-tokens 64] [--hidden 256] [--layers 4]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hybridrl.reshard.layout import hf_to_vllm_shards, vllm_shard_nbytes
from hybridrl.rollout.engine import RolloutEngine, RolloutEngineConfig
from hybridrl.rollout.sampling import RolloutSampling

RESULTS = Path(__file__).resolve().parent / "results" / "rollout.json"


def build_model(directory: Path, hidden: int, layers: int, vocab: int) -> tuple[dict, dict]:
    import transformers

    heads = hidden // 64  # head_dim 64: supported by vLLM's CPU attention
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
        max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, json.loads((directory / "config.json").read_text())


def hf_tokens_per_s(directory: Path, prompts: list[list[int]], n: int, max_tokens: int) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    ids = torch.tensor(prompts).repeat_interleave(n, dim=0)  # equal-length prompts: no padding needed
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
            do_sample=True, top_k=0, pad_token_id=0,
        )
    return ids.shape[0] * max_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "model"
        state, config = build_model(directory, args.hidden, args.layers, args.vocab)
        generator = torch.Generator().manual_seed(0)
        prompts = torch.randint(1, args.vocab, (args.prompts, args.prompt_len), generator=generator).tolist()

        engine = RolloutEngine(RolloutEngineConfig(
            model_path=str(directory), device="cpu", max_model_len=args.prompt_len + args.max_tokens,
            kv_cache_memory_bytes=64 << 20,
        ))
        sampling = RolloutSampling(n=args.n, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
        engine.generate_sequences(prompts, sampling)  # warm-up
        metrics = [engine.generate_sequences(prompts, sampling).meta["metrics"] for _ in range(args.repeats)]

        update_s = {}
        for weight_format in ("hf", "vllm_shard"):
            tensors = state if weight_format == "hf" else hf_to_vllm_shards(state, config, 1, 0)
            start = time.perf_counter()
            engine.update_weights(tensors.items(), weight_format=weight_format)
            update_s[weight_format] = time.perf_counter() - start

        result = {
            "model_params": sum(t.numel() for t in state.values()),
            "vllm_shard_bytes": vllm_shard_nbytes(config, 1),
            "engine_build_s": engine.build_seconds,
            "sequences_per_call": args.prompts * args.n,
            "vllm_tokens_per_s": statistics.median(m["rollout/tokens_per_s"] for m in metrics),
            "kv_cache_usage_bound": metrics[-1]["rollout/kv_cache_usage_bound"],
            "hf_generate_tokens_per_s": hf_tokens_per_s(directory, prompts, args.n, args.max_tokens),
            "update_weights_s": update_s,
            "threads": torch.get_num_threads(),
        }
    result["vllm_over_hf"] = result["vllm_tokens_per_s"] / result["hf_generate_tokens_per_s"]
    for key, value in result.items():
        print(f"{key:>26}: {value}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), **result}, indent=2))


if __name__ == "__main__":
    main()
