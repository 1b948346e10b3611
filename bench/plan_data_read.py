#!/usr/bin/env python
"""What the plan's read of a whole data file costs: `check_file` (every row read and checked as `train` checks it)
against `preview_file` (a parquet footer, a JSONL file's first lines), on GSM8K-like rows in parquet and JSONL.

Rows as tools/prepare_gsm8k.py writes them (a chat-message prompt of ~300 characters, the reward spec, the
data_source, an extra_info with the question and answer), at 7,473 rows (GSM8K's train split), 17,000
(DAPO-Math-17k), 50,000 (`hybridrl.data.dataset.WHOLE_READ_ROWS`, the most the plan reads whole) and 100,000 (read
whole here, past the plan's limit, for the figure). Each figure is the best of three in this process: CPU seconds
(what the read costs, whatever else the machine runs) and wall seconds.

    python bench/plan_data_read.py          # prints the figures; writes bench/results/plan_data_read.json
"""
from __future__ import annotations

import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridrl.data.dataset import check_file, preview_file  # noqa: E402
from hybridrl.data.io import write_rows  # noqa: E402

RESULT = ROOT / "bench" / "results" / "plan_data_read.json"
SIZES = (7_473, 17_000, 50_000, 100_000)
WORDS = ("Natalia", "sold", "clips", "to", "48", "of", "her", "friends", "in", "April", "and", "then", "half")


def gsm8k_like(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        question = " ".join(rng.choice(WORDS) for _ in range(45))
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question + ' Let\'s think step by step and output the final '
                                                              'answer after "####".'}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i % 1000)},
            "extra_info": {"split": "train", "index": i, "question": question,
                           "answer": "Natalia sold 48/2 = 24 clips in May. " * 4 + f"#### {i % 1000}"}})
    return rows


def best(function, repeats: int = 3) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of the fastest of `repeats` calls."""
    runs = []
    for _ in range(repeats):
        cpu, wall = time.process_time(), time.perf_counter()
        function()
        runs.append((time.process_time() - cpu, time.perf_counter() - wall))
    return min(runs)


def main() -> None:
    figures = []
    with tempfile.TemporaryDirectory() as folder:
        for count in SIZES:
            rows = gsm8k_like(count)
            for suffix in ("parquet", "jsonl"):
                path = write_rows(rows, Path(folder) / f"train_{count}.{suffix}")
                checked = check_file(path, "prompt", "reward_model", require_ground_truth=True, whole_rows=count)
                assert checked.whole and checked.rows == count and not checked.malformed_rows
                preview_cpu, preview_wall = best(lambda path=path: preview_file(path, "prompt"))
                whole_cpu, whole_wall = best(lambda path=path, count=count: check_file(
                    path, "prompt", "reward_model", require_ground_truth=True, whole_rows=count))
                figure = {"rows": count, "format": suffix, "mib": round(os.path.getsize(path) / 2**20, 1),
                          "preview_cpu_s": round(preview_cpu, 3), "preview_wall_s": round(preview_wall, 3),
                          "whole_cpu_s": round(whole_cpu, 3), "whole_wall_s": round(whole_wall, 3)}
                figures.append(figure)
                print(f"{count:>7,} rows {suffix:<7} {figure['mib']:>6.1f} MiB: preview {preview_cpu:.3f} s CPU "
                      f"({preview_wall:.3f} wall), whole read and check {whole_cpu:.3f} s CPU ({whole_wall:.3f} wall)")
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                  "load_average": os.getloadavg()[0], "figures": figures}, indent=1) + "\n")
    print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
