#!/usr/bin/env python
"""Build the demo's character-level tokenizer locally (no downloads) and save it.

    python tools/build_tokenizer.py --out DIR      # DIR/tokenizer.json + DIR/tokenizer_config.json

Load it with `hybridrl.data.tokenizer.load_tokenizer(DIR)` (or
`PreTrainedTokenizerFast(tokenizer_file=DIR/tokenizer.json)`); DIR may be the model folder.
"""
from __future__ import annotations

import argparse
import sys

from hybridrl.data.tokenizer import CHAR_CHAT_TEMPLATE, CHAR_VOCAB_SIZE, load_tokenizer, save_char_tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/tokenizer", help="folder to write the tokenizer files into")
    parser.add_argument("--no-chat-template", action="store_true", help="leave the chat template out")
    args = parser.parse_args(argv)
    path = save_char_tokenizer(args.out, chat_template=None if args.no_chat_template else CHAR_CHAT_TEMPLATE)
    tokenizer = load_tokenizer(args.out)
    assert len(tokenizer) == CHAR_VOCAB_SIZE, (len(tokenizer), CHAR_VOCAB_SIZE)
    print(f"wrote {path}: {len(tokenizer)} tokens (pad={tokenizer.pad_token_id}, bos={tokenizer.bos_token_id}, "
          f"eos={tokenizer.eos_token_id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
