#!/usr/bin/env python
"""Check that the demo task is learnable, without the distributed stack: plain-torch GRPO.

A randomly initialized model from configs/models/tiny-demo (transformers' Llama, CPU, fp32) trains
with on-policy GRPO (group-normalized advantages, token-mean loss, one AdamW step per batch) on
the "repeat the letter" prompts, through the real data path: `PromptDataset` from JSONL ->
`PromptDataLoader` -> left-padded `Batch` -> sampled responses -> `RewardManager.score_batch`.
It prints the mean reward every 10 steps. This tests the task design and the data/reward code,
not the trainer; the trainer's demo should learn at least as fast per step.

    python tools/probe_demo_task.py --steps 100 --samples 8 --seed 1   # ~20-40 s on one core
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from hybridrl.data.dataloader import PromptDataLoader
from hybridrl.data.dataset import PromptDataset
from hybridrl.data.demo_task import SCORER_NAME, RepeatLetterTask, random_baseline
from hybridrl.data.io import write_rows
from hybridrl.data.tokenizer import char_tokenizer
from hybridrl.rewards.manager import RewardManager

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="responses per prompt (GRPO group)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--response-length", type=int, default=16)
    parser.add_argument("--alphabet", default=RepeatLetterTask.alphabet)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)  # stable timing on shared cores (docs/platform.md)
    torch.manual_seed(args.seed)
    tokenizer = char_tokenizer()
    task = RepeatLetterTask(alphabet=args.alphabet)
    with tempfile.TemporaryDirectory() as tmp:
        train_file = write_rows(task.make_rows(args.prompts * args.steps, args.seed), Path(tmp) / "train.jsonl")
        dataset = PromptDataset(train_file, tokenizer, max_prompt_length=32)
    loader = PromptDataLoader(dataset, args.prompts, tokenizer.pad_token_id, seed=args.seed)
    rewards = RewardManager.from_name(SCORER_NAME)
    config = json.loads((REPO / "configs/models/tiny-demo/config.json").read_text())
    config.pop("architectures", None)
    model = LlamaForCausalLM(LlamaConfig(**config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    print(f"random-policy baseline: {random_baseline(tokenizer, task, max_length=args.response_length):.3f}")

    history: list[float] = []
    start = time.time()
    for step, batch in zip(range(args.steps), loader):
        batch = batch.index(torch.arange(len(batch)).repeat_interleave(args.samples))  # n samples per prompt
        prompt_ids, prompt_mask = batch["input_ids"], batch["attention_mask"]
        with torch.no_grad():
            sequences = model.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=args.response_length, eos_token_id=eos, pad_token_id=pad,
            )
        responses = sequences[:, prompt_ids.shape[1]:]
        is_eos = (responses == eos).long()
        response_mask = ((is_eos.cumsum(dim=1) - is_eos) == 0).long()  # up to and including the first EOS
        batch["responses"] = responses
        batch["response_mask"] = response_mask
        token_rewards, output = rewards.score_batch(batch, tokenizer)
        scores = token_rewards.sum(dim=1).view(-1, args.samples)
        advantages = (scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-6)
        attention = torch.cat([prompt_mask, response_mask], dim=1)
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        logits = model(input_ids=sequences, attention_mask=attention, position_ids=positions).logits
        logits = logits[:, prompt_ids.shape[1] - 1:-1]
        log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        mask = response_mask.float()
        loss = -(advantages.view(-1, 1) * log_probs * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        history.append(output.metrics["reward/score_mean"])
        if (step + 1) % 10 == 0:
            print(f"step {step + 1:4d}  reward {sum(history[-10:]) / 10:.3f}  "
                  f"length {mask.sum(1).mean():.1f}  {time.time() - start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
