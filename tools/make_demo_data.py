#!/usr/bin/env python
"""Write a CPU demo's synthetic prompts: "repeat the letter" (hybridrl/data/demo_task.py, `make demo`)
or "the secret letter" (hybridrl/data/secret_task.py, the tool-use demo, `make demo-tools`).

    python tools/make_demo_data.py                       # data/synthetic/{train,val}.jsonl
    python tools/make_demo_data.py --out-dir DIR --train-rows 2048 --val-rows 64 --seed 1 --format parquet
    python tools/make_demo_data.py --task secret --out-dir data/synthetic_secret
"""
from __future__ import annotations

import argparse
import sys

from hybridrl.data.demo_task import RepeatLetterTask
from hybridrl.data.io import write_task_splits
from hybridrl.data.secret_task import SecretLetterTask

TASKS = {"repeat": RepeatLetterTask, "secret": SecretLetterTask}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(TASKS), default="repeat")
    parser.add_argument("--out-dir", default="data/synthetic", help="folder for train/val files")
    parser.add_argument("--train-rows", type=int, default=4096)
    parser.add_argument("--val-rows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--alphabet", default=None, help="letters the rows use (default: the task's)")
    parser.add_argument("--min-length", type=int, default=None, help="the answer's length (default: the task's)")
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    args = parser.parse_args(argv)

    options = {k: v for k, v in (("alphabet", args.alphabet), ("min_length", args.min_length)) if v is not None}
    task = TASKS[args.task](**options)
    write_task_splits(task, args.out_dir, {"train": args.train_rows, "val": args.val_rows}, args.seed, args.format)
    return 0


if __name__ == "__main__":
    sys.exit(main())
