#!/usr/bin/env python
"""Build the CPU demo's model folder locally: random weights from a shipped config + the char tokenizer.

    python tools/make_demo_model.py                      # data/models/tiny-demo
    python tools/make_demo_model.py --config configs/models/tiny-demo/config.json --out DIR --seed 0

No downloads: the architecture comes from the shipped `config.json`, the weights from a seeded
random initialization (transformers' own), the tokenizer from `hybridrl.data.tokenizer`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def build(config_path: str | Path, out: str | Path, seed: int = 0) -> Path:
    import torch
    import transformers

    from hybridrl.data.tokenizer import CHAR_CHAT_TEMPLATE, save_char_tokenizer

    config_dict = json.loads(Path(config_path).read_text())
    architecture = config_dict["architectures"][0]
    fields = {k: v for k, v in config_dict.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model(config_dict["model_type"], **fields)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    save_char_tokenizer(out, chat_template=CHAR_CHAT_TEMPLATE)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/models/tiny-demo/config.json")
    parser.add_argument("--out", default="data/models/tiny-demo")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build(args.config, args.out, args.seed)
    print(f"wrote {path}: {sorted(p.name for p in path.iterdir())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
