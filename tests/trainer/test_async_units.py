"""The async rollout driver's bookkeeping on hand-built batches: groups, staleness, the metrics."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridrl.data.batch import Batch
from hybridrl.trainer.async_rollout import _concat_groups, _split_groups, staleness_metrics


def _rows(uids: list[str], versions: list[list[int]], prompt_width: int = 2, response_width: int = 4) -> Batch:
    rows = len(uids)
    versions_t = torch.full((rows, response_width), -1, dtype=torch.long)
    mask = torch.zeros((rows, response_width), dtype=torch.long)
    for r, v in enumerate(versions):
        versions_t[r, :len(v)] = torch.tensor(v)
        mask[r, :len(v)] = 1
    prompts = torch.ones((rows, prompt_width), dtype=torch.long)
    return Batch({"prompts": prompts, "responses": torch.zeros((rows, response_width), dtype=torch.long),
                  "input_ids": torch.cat([prompts, torch.zeros((rows, response_width), dtype=torch.long)], 1),
                  "attention_mask": torch.cat([torch.ones_like(prompts), mask], 1),
                  "position_ids": torch.arange(prompt_width + response_width).repeat(rows, 1),
                  "token_versions": versions_t},
                 {"uid": np.array(uids, dtype=object), "prompt_batch": np.array([3] * rows)},
                 {"pad_token_id": 0})


def test_groups_are_the_rows_of_one_prompt_and_their_oldest_token():
    batch = _rows(["a", "b", "a", "b"], [[2, 2, 3], [3], [1, 2], [3, 3, 3, 3]])
    groups = _split_groups(batch, None, None)
    assert [list(g.rows["uid"]) for g in groups] == [["a", "a"], ["b", "b"]]
    assert [g.oldest_version for g in groups] == [1, 3]  # the oldest token of any of the group's samples
    assert [g.prompt_batch for g in groups] == [3, 3]


def test_a_whole_batch_generation_tags_every_real_token_with_its_version():
    batch = _rows(["a", "a"], [[0, 0, 0], [0]])
    del batch.tensors["token_versions"]
    (group,) = _split_groups(batch, 5, 7)
    assert group.rows["token_versions"].tolist() == [[5, 5, 5, -1], [5, -1, -1, -1]]
    assert (group.oldest_version, group.prompt_batch) == (5, 7)


def test_staleness_is_the_trained_version_minus_each_samples_oldest_token():
    batch = _rows(["a", "a", "b", "b", "c"], [[4, 5], [5, 5], [3, 4, 5], [2], [5, 5, 5]])
    metrics = staleness_metrics(batch, trained_version=5)
    # per sample: 5-4, 5-5, 5-3, 5-2, 5-5 = 1, 0, 2, 3, 0
    assert metrics["async/staleness_mean"] == pytest.approx(6 / 5)
    assert metrics["async/staleness_max"] == 3
    assert (metrics["async/staleness_0"], metrics["async/staleness_1"], metrics["async/staleness_2"],
            metrics["async/staleness_3+"]) == pytest.approx((0.4, 0.2, 0.2, 0.2))
    assert metrics["async/weight_version"] == 5


def test_groups_of_different_prompt_widths_line_up_in_one_batch():
    narrow, wide = _rows(["a"], [[1]], prompt_width=2), _rows(["b"], [[1]], prompt_width=5)
    batch = _concat_groups([narrow, wide])
    assert batch["prompts"].shape == (2, 5) and batch["input_ids"].shape == (2, 9)
    assert batch["attention_mask"][0].tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0]  # left padding added to the narrow one
    assert batch["token_versions"][0].tolist() == [1, -1, -1, -1]


def test_partial_samples_are_counted_and_their_versions_checked():
    batch = _rows(["a", "a", "b", "b"], [[4, 5], [5, 5, 5], [3, 5, 4], [5]])
    batch["resumed"] = torch.tensor([1, 1, 2, 0])  # the second "partial" sample never saw a new version
    metrics = staleness_metrics(batch, trained_version=5)
    assert metrics["async/partial_samples"] == 3 and metrics["async/partial_sample_fraction"] == 0.75
    assert metrics["async/partial_samples_mixed_versions"] == 2  # [4, 5] and [3, 5, 4]
    assert metrics["async/token_versions_ordered_fraction"] == 0.75  # [3, 5, 4] goes back a version
