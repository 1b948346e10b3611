"""docs/performance.md's cross-pool sync table is bench/results/reshard_cross_pool.json, row for row (the file
`python bench/reshard.py --cross-pool` writes), and the bytes in it are the sync's bounds."""
from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULT = json.loads((ROOT / "bench" / "results" / "reshard_cross_pool.json").read_text())


def _doc_rows() -> list[list[str]]:
    text = (ROOT / "docs" / "performance.md").read_text()
    table = text.split("| trainer pool -> rollout pool |", 1)[1].split("\n\n", 1)[0]
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def test_the_doc_table_is_the_result_file():
    doc = _doc_rows()
    assert len(doc) == len(RESULT["rows"])
    for cells, row in zip(doc, RESULT["rows"], strict=True):
        assert cells[1] == f"{row['recv_max_mib']:.2f} ({row['recv_ratio']:.3f})", (cells, row["layout"])
        assert cells[2] == f"{row['sent_max_mib']:.2f} ({row['sent_even_mib']:.2f})", (cells, row["layout"])
        assert cells[3] == f"{row['send_balance']:.3f}" and cells[4] == f"{row['sync_s_max']:.2f}"
        assert cells[5] == ("yes" if row["checksums_equal"] else "no")


def test_every_rollout_rank_received_its_bound_and_the_plan_said_so():
    for row in RESULT["rows"]:
        assert row["checksums_equal"] and row["recv_ratio"] == 1.0, row
        assert row["recv_max_mib"] == row["recv_plan_mib"] and row["sent_even_mib"] == row["sent_plan_even_mib"], row
        assert re.match(r"tp\dpp\dw\d -> \dx tp\d", row["layout"])
