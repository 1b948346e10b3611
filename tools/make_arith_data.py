#!/usr/bin/env python
"""Write the arithmetic word problems of `make demo-real` (see hybridrl/data/arith_task.py).

    python tools/make_arith_data.py                      # data/arith/{train,val}.jsonl
    python tools/make_arith_data.py --out-dir DIR --train-rows 2048 --val-rows 64 --seed 1 --steps 2 3
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python tools/...` resolves hybridrl to this checkout
    sys.path.insert(0, str(REPO))

from hybridrl.data.arith_task import ArithWordTask  # noqa: E402 (after the path fix above)
from hybridrl.data.io import write_task_splits  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="data/arith", help="folder for train/val files")
    parser.add_argument("--train-rows", type=int, default=2048)
    parser.add_argument("--val-rows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, nargs=2, default=ArithWordTask.steps, metavar=("LOW", "HIGH"),
                        help="changes per problem (inclusive range)")
    parser.add_argument("--max-start", type=int, default=ArithWordTask.max_start)
    parser.add_argument("--max-change", type=int, default=ArithWordTask.max_change)
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    args = parser.parse_args(argv)

    try:
        task = ArithWordTask(steps=tuple(args.steps), max_start=args.max_start, max_change=args.max_change)
    except ValueError as error:
        parser.error(str(error))
    write_task_splits(task, args.out_dir, {"train": args.train_rows, "val": args.val_rows}, args.seed, args.format)
    return 0


if __name__ == "__main__":
    sys.exit(main())
