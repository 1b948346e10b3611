#!/usr/bin/env python
"""Build the CPU demo's model folder locally: random weights from a shipped config + the char tokenizer.

    python tools/make_demo_model.py                      # data/models/tiny-demo
    python tools/make_demo_model.py --config configs/models/tiny-demo/config.json --out DIR --seed 0
    python tools/make_demo_model.py --chat-template tool --copy-warmup 300 --out data/models/tiny-demo-tools

No downloads: the architecture comes from the shipped `config.json`, the weights from a seeded
random initialization (transformers' own), the tokenizer from `hybridrl.data.tokenizer` with one of
its chat templates (`CHAT_TEMPLATES`: "chat", or "tool" for the tool-use demo).

`--copy-warmup STEPS` (the tool-use demo, `make demo-tools`): before saving, STEPS steps of plain
next-token training (AdamW, lr 1e-3, 32 sequences of 40 tokens) on synthetic text, "random characters,
then one lowercase letter repeated 3-10 times". The loss is on the random characters (so after them the model
stays near uniform: it still writes any character, a call mark or EOS, now and then) and on the run
from its third letter on (so it learns to continue a letter it has read twice). That is the one skill
a pretrained model brings to tool use, reading back what it was told; the text holds no tool, no call
mark in any role, nothing of the demo's task.
"""
from __future__ import annotations

import argparse
import json
import random
import string
import sys
from pathlib import Path
from typing import Any

WARMUP_BATCH, WARMUP_LENGTH, WARMUP_LR = 32, 40, 1e-3


def copy_warmup_batch(rng: random.Random, characters: list[int], letters: list[int]) -> tuple[list[list[int]],
                                                                                              list[list[int]]]:
    """One batch of (token ids, target per position: the id it must predict there, -100 for none)."""
    inputs, targets = [], []
    for _ in range(WARMUP_BATCH):
        prefix = [rng.choice(characters) for _ in range(rng.randint(4, WARMUP_LENGTH - 10))]
        letter, run = rng.choice(letters), rng.randint(3, 10)
        ids = prefix + [letter] * run
        # position i predicts ids[i + 1]: every random character and the run's first letter (random too),
        # not its second (after one letter the text may go on at random), then the rest of the run
        target = prefix[1:] + [letter, -100] + [letter] * (run - 2) + [-100]
        pad = WARMUP_LENGTH - len(ids)
        inputs.append(ids + [0] * pad)
        targets.append(target + [-100] * pad)
    return inputs, targets


def copy_warmup(model: Any, tokenizer: Any, steps: int, seed: int) -> list[float]:
    """Train `model` in place on the copy warm-up text (module docstring); returns the losses."""
    import torch

    from hybridrl.data.tokenizer import CHARACTERS

    characters = [tokenizer.convert_tokens_to_ids(c) for c in CHARACTERS] + [tokenizer.eos_token_id]
    letters = [tokenizer.convert_tokens_to_ids(c) for c in string.ascii_lowercase]
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARMUP_LR, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        inputs, targets = (torch.tensor(t) for t in copy_warmup_batch(rng, characters, letters))
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def build(config_path: str | Path, out: str | Path, seed: int = 0, chat_template: str = "chat",
          copy_warmup_steps: int = 0) -> Path:
    import torch
    import transformers

    from hybridrl.data.tokenizer import CHAT_TEMPLATES, load_tokenizer, save_char_tokenizer

    config_dict = json.loads(Path(config_path).read_text())
    architecture = config_dict["architectures"][0]
    fields = {k: v for k, v in config_dict.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model(config_dict["model_type"], **fields)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_char_tokenizer(out, chat_template=CHAT_TEMPLATES[chat_template])
    if copy_warmup_steps:
        losses = copy_warmup(model, load_tokenizer(out), copy_warmup_steps, seed)
        print(f"copy warm-up: {copy_warmup_steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    model.save_pretrained(out, safe_serialization=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from hybridrl.data.tokenizer import CHAT_TEMPLATES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/models/tiny-demo/config.json")
    parser.add_argument("--out", default="data/models/tiny-demo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat-template", choices=sorted(CHAT_TEMPLATES), default="chat")
    parser.add_argument("--copy-warmup", type=int, default=0, metavar="STEPS",
                        help="next-token steps on 'random characters, then a letter repeated' (0: none)")
    args = parser.parse_args(argv)
    path = build(args.config, args.out, args.seed, args.chat_template, args.copy_warmup)
    print(f"wrote {path}: {sorted(p.name for p in path.iterdir())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
