#!/usr/bin/env python
"""A teacher for the CPU demo's on-policy distillation: the demo model taught the task by plain supervised
fine-tuning, saved as a Hugging Face folder with the student's tokenizer.

    python tools/make_demo_teacher.py                          # data/models/tiny-demo -> data/models/tiny-demo-teacher
    python tools/make_demo_teacher.py --student DIR --data data/synthetic/train.jsonl --out DIR --steps 150

The student is `tools/make_demo_model.py`'s random model; the teacher starts from the same folder and learns, with
transformers and AdamW (the loss on the answer only), to answer each training prompt ("repeat: cccc", tokenized
by hybridrl's own `PromptDataset`, as the trainer does) with its letter `--answer-tokens` times. That is a teacher
that knows the task the student does not: distilling from it (`algorithm.distillation`) raises the student's
reward without the reward being trained on. Seconds on a CPU; the figures it prints are the teacher's greedy score.
"""
from __future__ import annotations

import argparse
import random
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def make_demo_teacher(student: Path, data: Path, out: Path, *, steps: int = 150, lr: float = 3e-3,
                      batch: int = 32, answer_tokens: int = 16, seed: int = 0) -> float:
    """Fine-tune `student`'s weights on `data`'s prompts into `out`; returns the teacher's greedy score (the
    fraction of its greedy answer tokens that are the prompt's letter, over every training prompt)."""
    import torch
    import transformers

    from hybridrl.data.dataset import PromptDataset
    from hybridrl.data.tokenizer import load_tokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = load_tokenizer(student)
    prompts = PromptDataset(data, tokenizer, max_prompt_length=64)
    examples = [(list(item.input_ids), tokenizer.convert_tokens_to_ids(str(item.ground_truth)[0]))
                for item in prompts]
    model = transformers.AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    pad = tokenizer.pad_token_id or 0
    model.train()
    for _ in range(steps):
        rows = [rng.choice(examples) for _ in range(batch)]
        width = max(len(ids) for ids, _ in rows) + answer_tokens
        inputs = torch.full((batch, width), pad, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for row, (ids, letter) in enumerate(rows):
            sequence = ids + [letter] * answer_tokens
            inputs[row, :len(sequence)] = torch.tensor(sequence)
            labels[row, len(ids):len(sequence)] = letter  # the loss on the answer only
            attention[row, :len(sequence)] = 1
        loss = model(input_ids=inputs, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    hits = total = 0
    with torch.no_grad():
        for ids, letter in examples[:64]:
            generated = model.generate(torch.tensor([ids]), max_new_tokens=answer_tokens, do_sample=False,
                                       pad_token_id=pad)[0, len(ids):]
            hits += int((generated == letter).sum())
            total += answer_tokens
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:  # the student's tokenizer, byte for byte: distillation checks they are one
        if (student / name).is_file():
            shutil.copyfile(student / name, out / name)
    return hits / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--student", type=Path, default=ROOT / "data/models/tiny-demo")
    parser.add_argument("--data", type=Path, default=ROOT / "data/synthetic/train.jsonl")
    parser.add_argument("--out", type=Path, default=ROOT / "data/models/tiny-demo-teacher")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    score = make_demo_teacher(args.student, args.data, args.out, steps=args.steps, seed=args.seed)
    print(f"teacher written to {args.out}: greedy score {score:.3f} on the training prompts")


if __name__ == "__main__":
    main()
