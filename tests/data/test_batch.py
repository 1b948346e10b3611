"""Batch: row operations keep tensors and metadata aligned; transport is zero-copy through Ray."""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

from hybridrl.data.batch import Batch


def make_batch(rows: int = 6) -> Batch:
    return Batch(
        tensors={
            "input_ids": torch.arange(rows * 4).reshape(rows, 4),
            "logp": torch.linspace(0, 1, rows * 3).reshape(rows, 3).to(torch.bfloat16),
        },
        non_tensors={
            "uid": [f"u{i}" for i in range(rows)],
            "group": np.arange(rows) // 2,
            "ragged": [[i] * (i % 3) for i in range(rows)],
        },
        meta={"temperature": 0.7},
    )


def assert_rows(batch: Batch, source: Batch, rows: list[int]) -> None:
    """`batch` holds exactly `source`'s rows `rows`, in that order, in every column."""
    assert len(batch) == len(rows)
    for key, tensor in source.tensors.items():
        assert torch.equal(batch[key], tensor[rows]), key
        assert batch[key].dtype == tensor.dtype
    for key, array in source.non_tensors.items():
        assert list(batch[key]) == [array[i] for i in rows], key


def test_construction_validates_rows_and_keeps_ragged_metadata_one_dimensional():
    batch = make_batch()
    assert len(batch) == 6
    assert batch["ragged"].shape == (6,) and batch["ragged"].dtype == object
    with pytest.raises(ValueError, match="disagree on the number of rows"):
        Batch({"a": torch.zeros(3, 2)}, {"uid": ["x", "y"]})
    with pytest.raises(TypeError, match="put it in `tensors`"):
        Batch({"a": torch.zeros(2)}, {"b": torch.zeros(2)})
    with pytest.raises(ValueError, match="at least one"):
        Batch()


def test_typed_access_returns_the_column_or_names_it_when_it_is_the_other_kind():
    batch = make_batch()
    assert batch.tensor("input_ids") is batch.tensors["input_ids"]
    assert batch.column("uid") is batch.non_tensors["uid"]
    with pytest.raises(TypeError, match=r"column 'uid' is a per-row array \(object\), not a tensor"):
        batch.tensor("uid")
    with pytest.raises(TypeError, match="column 'logp' is a tensor, not a per-row array"):
        batch.column("logp")
    with pytest.raises(KeyError, match="'missing' is not a column of this batch"):
        batch.tensor("missing")


def test_split_concat_round_trip_keeps_metadata_aligned():
    batch = make_batch(6)
    chunks = batch.split(3)
    assert [len(c) for c in chunks] == [2, 2, 2]
    assert_rows(chunks[1], batch, [2, 3])
    assert chunks[1].meta == {"temperature": 0.7}
    assert_rows(Batch.concat(chunks), batch, list(range(6)))
    uneven = batch.split_sizes([1, 0, 5])
    assert [len(c) for c in uneven] == [1, 0, 5]
    assert_rows(Batch.concat(uneven), batch, list(range(6)))


def test_split_errors_name_the_sizes():
    batch = make_batch(6)
    with pytest.raises(ValueError, match=r"batch of 6 rows into 4 equal chunks"):
        batch.split(4)
    with pytest.raises(ValueError, match=r"\[2, 2\] sum to 4, the batch has 6"):
        batch.split_sizes([2, 2])
    with pytest.raises(ValueError, match="batch 1 has columns"):
        Batch.concat([batch, batch.select(["input_ids"])])


def test_pad_repeats_rows_and_unpad_restores():
    batch = make_batch(5)
    padded, pad = batch.pad_to_multiple(4)
    assert pad == 3 and len(padded) == 8
    assert_rows(padded, batch, [0, 1, 2, 3, 4, 0, 1, 2])
    assert_rows(padded.unpad(pad), batch, list(range(5)))
    same, zero = batch.pad_to_multiple(5)
    assert zero == 0 and same is batch
    # pad -> split -> concat -> unpad is the dispatch round trip
    assert_rows(Batch.concat(padded.split(4)).unpad(pad), batch, list(range(5)))


def test_index_reorder_select():
    batch = make_batch(6)
    perm = [5, 0, 3, 1, 4, 2]
    assert_rows(batch.reorder(perm), batch, perm)
    assert_rows(batch.index([1, 1, -1]), batch, [1, 1, 5])
    with pytest.raises(ValueError, match="permutation"):
        batch.reorder([0, 0, 1, 2, 3, 4])
    with pytest.raises(IndexError):
        batch.index([6])
    selected = batch.select(["input_ids", "uid"])
    assert selected.keys() == ["input_ids", "uid"] and selected.meta == batch.meta
    with pytest.raises(KeyError, match="not in this batch"):
        batch.select(["nope"])


def test_setitem_checks_rows():
    batch = make_batch(4)
    batch["advantages"] = torch.ones(4)
    batch["source"] = ["a", "b", "c", "d"]
    assert "advantages" in batch.tensors and "source" in batch.non_tensors
    with pytest.raises(ValueError, match="has 3 rows, the batch has 4"):
        batch["bad"] = torch.ones(3)


def test_pickle_round_trip_preserves_dtypes_including_bfloat16():
    batch = make_batch(4)
    batch["strided"] = torch.arange(32.0).reshape(4, 8)[:, ::2]  # non-contiguous
    batch["grad"] = torch.ones(4, 2, requires_grad=True) * 2  # autograd history is dropped
    for restored in (pickle.loads(pickle.dumps(batch, protocol=5)), copy.deepcopy(batch)):
        for key, tensor in batch.tensors.items():
            assert restored[key].dtype == tensor.dtype, key
            assert torch.equal(restored[key], tensor.detach()), key
        assert not restored["grad"].requires_grad
        assert list(restored["ragged"]) == list(batch["ragged"])
        assert restored.meta == batch.meta
        assert restored.shared_keys == frozenset()  # in-band pickles build private, writable arrays


def test_ray_get_is_zero_copy_and_make_writable_copies_only_shared(ray_cluster):
    import ray

    batch = make_batch(8)
    batch["big"] = torch.randn(8, 1 << 16)  # 2 MiB: large enough to live in the shared object store
    ref = ray.put(batch)
    restored, second = ray.get(ref), ray.get(ref)
    assert "big" in restored.shared_keys
    # Both gets map the same shared memory: no copy per get.
    assert restored["big"].data_ptr() == second["big"].data_ptr() != batch["big"].data_ptr()
    assert torch.equal(restored["big"], batch["big"])
    assert restored["logp"].dtype == torch.bfloat16 and torch.equal(restored["logp"], batch["logp"])
    assert_rows(restored, batch, list(range(8)))
    again = ray.get(ray.put(restored))  # re-put of an arrived (read-only) batch works too
    assert torch.equal(again["big"], batch["big"])
    big_before = restored["big"]
    restored.make_writable()
    assert restored.shared_keys == frozenset()
    assert restored["big"].data_ptr() != big_before.data_ptr()
    restored["big"].add_(1.0)  # now safe: a private copy
    assert torch.equal(ray.get(ray.put(batch))["big"], batch["big"])
