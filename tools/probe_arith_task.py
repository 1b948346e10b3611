#!/usr/bin/env python
"""Measure a model's score on the arithmetic word problems before any training (real vLLM, CPU).

    python tools/probe_arith_task.py                                  # the smollm2 folder, 32 prompts
    python tools/probe_arith_task.py --model DIR --prompts 64 --n 4 --temperature 1.0 --steps 2 3

The prompts go through the same path as training: `PromptDataset` with the model's chat template,
`RolloutEngine` (vLLM, TP1, in this process, the model folder's EOS ids as stop tokens), the
registered `arith_word` scorer on the decoded responses. Prints the sampled score (as the config
samples) and the greedy score (as validation decodes), and a few responses.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python tools/...` resolves hybridrl to this checkout
    sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "data" / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt at --temperature")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--steps", type=int, nargs=2, default=None, help="changes per problem (low high)")
    parser.add_argument("--max-start", type=int, default=None)
    parser.add_argument("--max-change", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=4, help="responses to print")
    args = parser.parse_args(argv)

    from hybridrl.data.arith_task import ArithWordTask, arith_word_score
    from hybridrl.data.dataset import PromptDataset
    from hybridrl.data.io import write_rows
    from hybridrl.data.tokenizer import load_tokenizer
    from hybridrl.rollout.engine import RolloutEngine, RolloutEngineConfig
    from hybridrl.rollout.sampling import RolloutSampling, validation_sampling

    options = {k: v for k, v in (("steps", tuple(args.steps) if args.steps else None),
                                 ("max_start", args.max_start), ("max_change", args.max_change)) if v is not None}
    task = ArithWordTask(**options)
    tokenizer = load_tokenizer(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_rows(task.make_rows(args.prompts, args.seed, split="probe"), Path(tmp) / "probe.jsonl")
        dataset = PromptDataset(path, tokenizer, apply_chat_template=True, max_prompt_length=256)
    prompts = [list(item.input_ids) for item in dataset]
    truths = [item.ground_truth for item in dataset]
    engine = RolloutEngine(RolloutEngineConfig(model_path=args.model, device="cpu", max_model_len=512,
                                               kv_cache_memory_bytes=512 << 20))
    results: dict[str, float | int | list[int] | str] = {"model": args.model, "task": repr(task),
                                                         "prompts": len(prompts)}
    runs = (("sampled", RolloutSampling(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens,
                                        seed=args.seed)),
            ("greedy", validation_sampling(args.max_tokens)))
    for label, sampling in runs:
        started = time.perf_counter()
        batch = engine.generate_sequences(prompts, sampling)
        seconds = time.perf_counter() - started
        responses, mask = batch["responses"], batch["response_mask"]
        texts = [tokenizer.decode(responses[i][mask[i].bool()].tolist(), skip_special_tokens=True)
                 for i in range(len(responses))]
        scores = [arith_word_score(text, truths[i // sampling.n]).score for i, text in enumerate(texts)]
        results[f"{label}_score"] = round(sum(scores) / len(scores), 4)
        results[f"{label}_mean_response_tokens"] = round(float(mask.sum(-1).float().mean()), 1)
        results[f"{label}_generate_s"] = round(seconds, 1)
        for i in range(min(args.show, len(texts))):
            print(f"[{label}] truth {truths[i // sampling.n]} score {scores[i]}: {texts[i]!r}")
    results["eos_token_ids"] = list(engine.eos_token_ids)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
