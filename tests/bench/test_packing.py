"""bench/packing.py at a toy size: its batch is the ragged case it promises, and its arithmetic
(tokens counted, padding ratios, DP imbalance, tokens/s, speed-ups) agrees with values computed
here from the batch itself."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import packing  # noqa: E402

pytestmark = pytest.mark.slow
ARGS = ["--toy", "--rows", "16", "--max-prompt", "8", "--max-response", "64", "--median", "8", "--long-rows", "1",
        "--micro", "2", "--max-tokens", "128", "--repeats", "1", "--rounds", "1"]


def test_ragged_batch_is_long_tailed():
    lengths = packing.response_lengths(64, 512, median=32, sigma=0.9, long_rows=3, seed=0)
    assert lengths.max() >= 8 * lengths.min() and lengths.max() <= 512
    assert (lengths >= 0.9 * 512).sum() >= 3  # a few near the maximum
    assert (lengths <= 64).mean() > 0.6  # most short


def test_bench_counts_what_the_batch_holds(tmp_path):
    report = packing.main([*ARGS, "--out", str(tmp_path / "packing.json")])
    args = packing.parse_args(ARGS)
    batch = packing.ragged_batch(args.rows, packing.TOY_MODEL["vocab_size"], max_prompt=args.max_prompt,
                                 max_response=args.max_response, median=args.median, sigma=args.sigma,
                                 long_rows=args.long_rows, seed=args.seed)
    lengths = batch.tensors["attention_mask"].sum(-1).tolist()
    tokens = sum(lengths)
    assert report["tokens"] == tokens
    assert report["response_lengths"]["max"] >= 8 * report["response_lengths"]["min"]
    # the plain split: rows 0-7 on rank 0, 8-15 on rank 1; micro-batches of 2 consecutive rows, each
    # computed at its longest row's width
    chunks = [lengths[:8], lengths[8:]]
    plain_imbalance = max(map(sum, chunks)) / (tokens / 2)
    computed = sum(2 * max(chunk[i:i + 2]) for chunk in chunks for i in range(0, 8, 2))
    modes = {row["mode"]: row for row in report["modes"]}
    assert list(modes) == list(packing.MODES)
    padded = modes["padded"]
    for name in ("update", "log_prob"):
        for row in modes.values():
            # every rank's micro-batches together hold each real token of the batch once
            assert row[f"{name}_real_tokens"] == tokens
            assert sum(r["chunk_tokens"] for r in row["ranks"]) == tokens
            assert row[f"{name}_tokens_per_s"] == pytest.approx(tokens / row[f"{name}_s"])
            assert row[f"{name}_speedup"] == pytest.approx(row[f"{name}_tokens_per_s"] / padded[f"{name}_tokens_per_s"])
        assert padded[f"{name}_computed_tokens"] == computed
        assert padded[f"{name}_padding_ratio"] == pytest.approx(1 - tokens / computed)
        for mode in packing.MODES[1:]:
            assert modes[mode][f"{name}_padding_ratio"] == 0.0 and modes[mode][f"{name}_computed_tokens"] == tokens
    assert padded["dp_token_imbalance"] == pytest.approx(plain_imbalance)
    assert modes["packed"]["dp_token_imbalance"] == pytest.approx(plain_imbalance)
    # balanced: each rank's rows are the ones the dispatch order gives it, and they are more even
    balanced = modes["packed_balanced"]
    ranks = sorted(balanced["ranks"], key=lambda r: r["dp"])
    assert balanced["dp_token_imbalance"] == pytest.approx(max(r["chunk_tokens"] for r in ranks) / (tokens / 2))
    assert balanced["dp_token_imbalance"] <= plain_imbalance
    assert (tmp_path / "packing.json").is_file()
    assert "| padded |" in packing.table(report)
