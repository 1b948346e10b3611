#!/usr/bin/env python
"""Convert a local GSM8K-style file (JSONL or parquet rows with `question` and `answer` ending in
`#### N`) into hybridrl's training format (chat-message prompts, rule ground truth, data_source
"openai/gsm8k"); see hybridrl/data/gsm8k.py. Nothing is downloaded.

    python tools/prepare_gsm8k.py --input gsm8k/train.jsonl --output data/gsm8k/train.parquet --split train
    python tools/prepare_gsm8k.py --input gsm8k/test.jsonl --output data/gsm8k/test.jsonl --split test

Train with data.apply_chat_template=true and algorithm.reward_fn=gsm8k.
"""
from __future__ import annotations

import argparse
import sys

from hybridrl.data.dataset import DatasetError, read_rows
from hybridrl.data.gsm8k import DEFAULT_INSTRUCTION, Gsm8kFormatError, convert_rows
from hybridrl.data.io import write_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="GSM8K-style .jsonl or .parquet")
    parser.add_argument("--output", required=True, help="output .jsonl or .parquet")
    parser.add_argument("--split", default="train", help="recorded in extra_info")
    parser.add_argument("--instruction", default=DEFAULT_INSTRUCTION, help="appended to each question")
    parser.add_argument("--skip-bad", action="store_true", help="skip (and count) rows without a '####' answer")
    args = parser.parse_args(argv)
    try:
        rows = read_rows(args.input)
        converted, report = convert_rows(rows, args.split, args.instruction, skip_bad=args.skip_bad)
    except (DatasetError, Gsm8kFormatError) as error:
        print(f"error: {args.input}: {error}", file=sys.stderr)
        return 1
    if not converted:
        print(f"error: {args.input}: no rows to convert", file=sys.stderr)
        return 1
    write_rows(converted, args.output)
    print(f"wrote {report.converted} rows to {args.output}")
    if report.skipped:
        print(f"skipped {len(report.skipped)} rows, e.g. {report.skipped[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
