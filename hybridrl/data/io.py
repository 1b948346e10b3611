"""Writing rows in the training format: JSON lines or parquet, chosen by the file suffix.

Reading is `hybridrl.data.dataset.read_rows` (pyarrow). Writing JSONL needs no parser: each row is
one `json.dumps` line.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridrl.data.dataset import JSONL_SUFFIXES, PARQUET_SUFFIXES
from hybridrl.persistence import atomic_file


def write_rows(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Write `rows` to `path` (.jsonl/.json/.ndjson or .parquet/.pq); parent folders are created."""
    path = Path(path)
    suffix = path.suffix.lower()
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix in JSONL_SUFFIXES:
        # Written to a partial name first: a crash never leaves a half file that looks complete.
        with atomic_file(path) as partial, partial.open("w", encoding="utf-8") as out:
            for row in rows:
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
        return path
    if suffix in PARQUET_SUFFIXES:
        import pyarrow as pa
        import pyarrow.parquet as pq

        with atomic_file(path) as partial:
            pq.write_table(pa.Table.from_pylist(list(rows)), partial)
        return path
    raise ValueError(f"{path}: unsupported suffix {suffix!r}; use .jsonl or .parquet")


def write_task_splits(task: Any, out_dir: str | Path, rows_per_split: dict[str, int], seed: int,
                      file_format: str = "jsonl") -> list[Path]:
    """A synthetic task's splits (`task.make_rows(rows, seed, split)`) as `<out_dir>/<split>.<format>`,
    each reported on stdout: what the data tools in `tools/` write."""
    written = []
    for split, rows in rows_per_split.items():
        path = write_rows(task.make_rows(rows, seed, split), Path(out_dir) / f"{split}.{file_format}")
        print(f"wrote {rows} {split} rows to {path}")
        written.append(path)
    return written
