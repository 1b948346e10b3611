"""Collation (left padding, masks, positions, metadata) and the deterministic, resumable loader."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridrl.data.dataloader import PromptDataLoader, collate_prompts, unpadded_prompt_ids
from hybridrl.data.dataset import PromptItem

PAD = 0


def item(ids: list[int], index: int, truth: str = "t", source: str = "toy") -> PromptItem:
    return PromptItem(
        input_ids=tuple(ids), prompt_text=f"p{index}", raw_prompt=f"p{index}", reward_spec={"ground_truth": truth},
        ground_truth=truth, data_source=source, index=index, extra_info={"k": index},
    )


def items(count: int) -> list[PromptItem]:
    return [item([10 + i] * (1 + i % 3), index=i, truth=str(i)) for i in range(count)]


def test_collate_left_pads_a_handmade_example() -> None:
    batch = collate_prompts([item([5, 6, 7], 0, "a"), item([8], 1, "b", "other")], PAD, uids=["u0", "u1"])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [PAD, PAD, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]
    assert batch["input_ids"].dtype == torch.long
    assert list(batch["uid"]) == ["u0", "u1"]
    assert list(batch["ground_truth"]) == ["a", "b"]
    assert list(batch["data_source"]) == ["toy", "other"]
    assert batch["index"].tolist() == [0, 1]
    assert list(batch["reward_spec"]) == [{"ground_truth": "a"}, {"ground_truth": "b"}]
    assert list(batch["extra_info"]) == [{"k": 0}, {"k": 1}]
    assert unpadded_prompt_ids(batch) == [[5, 6, 7], [8]]


def test_collate_pad_to_length_and_errors() -> None:
    batch = collate_prompts([item([5, 6], 0)], PAD, pad_to_length=4)
    assert batch["input_ids"].tolist() == [[PAD, PAD, 5, 6]]
    assert batch["position_ids"].tolist() == [[0, 0, 0, 1]]
    with pytest.raises(ValueError, match="shorter than the longest prompt"):
        collate_prompts([item([5, 6, 7], 0)], PAD, pad_to_length=2)
    with pytest.raises(ValueError, match="unique"):
        collate_prompts([item([5], 0), item([6], 1)], PAD, uids=["same", "same"])
    with pytest.raises(ValueError, match="empty"):
        collate_prompts([], PAD)


def test_collated_batch_survives_batch_operations() -> None:
    batch = collate_prompts(items(4), PAD)
    repeated = batch.index(np.arange(4).repeat(2))  # what rollout.n does
    assert list(repeated["uid"]) == [u for u in batch["uid"] for _ in range(2)]
    assert repeated["input_ids"].shape == (8, batch["input_ids"].shape[1])


def batches_as_lists(loader, limit: int | None = None) -> list[tuple[list[int], list[str]]]:
    seen = []
    for batch in loader:
        seen.append((batch["index"].tolist(), list(batch["uid"])))
        if limit is not None and len(seen) == limit:
            break
    return seen


def test_shuffle_is_deterministic_per_seed_and_epoch() -> None:
    data = items(10)
    a = PromptDataLoader(data, 3, PAD, seed=7)
    b = PromptDataLoader(data, 3, PAD, seed=7)
    assert batches_as_lists(a) == batches_as_lists(b)
    epoch1_a, epoch1_b = batches_as_lists(a), batches_as_lists(b)  # second epoch: a new order, same on both
    assert epoch1_a == epoch1_b
    assert np.array_equal(a.epoch_order(0), PromptDataLoader(data, 3, PAD, seed=7).epoch_order(0))
    assert not np.array_equal(a.epoch_order(0), a.epoch_order(1))
    assert not np.array_equal(a.epoch_order(0), PromptDataLoader(data, 3, PAD, seed=8).epoch_order(0))
    assert a.epoch == 2


def test_drop_last_gives_fixed_batches_and_validation_keeps_all() -> None:
    data = items(10)
    train = PromptDataLoader(data, 3, PAD, seed=0)
    sizes = [len(batch) for batch in train]
    assert sizes == [3, 3, 3] and len(train) == 3
    val = PromptDataLoader(data, 3, PAD, shuffle=False, drop_last=False)
    val_batches = batches_as_lists(val)
    assert [indices for indices, _ in val_batches] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert len(val) == 4
    with pytest.raises(ValueError, match="fewer than one batch"):
        PromptDataLoader(items(2), 3, PAD)


def test_the_prompts_whole_batches_leave_out_are_said() -> None:
    """Batches are whole, so 10 prompts in batches of 4 leave 2 out of each epoch: without shuffling the same last two,
    never trained on, which the trainer's log must say (counted here from what three epochs hand out)."""
    for shuffle in (False, True):
        loader = PromptDataLoader(items(10), 4, PAD, shuffle=shuffle, seed=3)
        seen_per_epoch = [{i for indices, _ in batches_as_lists(loader) for i in indices} for _ in range(3)]
        assert all(len(seen) == 8 for seen in seen_per_epoch)
        never = set(range(10)) - set().union(*seen_per_epoch)
        note = loader.left_out_note()
        assert note is not None and "2 of the 10 prompts (not a multiple of the batch size 4)" in note
        if shuffle:
            assert len({frozenset(seen) for seen in seen_per_epoch}) > 1 and "a different 2 each epoch" in note
        else:
            assert never == {8, 9} and "the last ones in file order: they are never trained on" in note
    assert PromptDataLoader(items(12), 4, PAD).left_out_note() is None
    assert PromptDataLoader(items(10), 4, PAD, drop_last=False).left_out_note() is None  # validation scores all


def test_resume_mid_epoch_gives_the_same_remaining_batches() -> None:
    data = items(23)
    uninterrupted = PromptDataLoader(data, 4, PAD, seed=3)
    reference = batches_as_lists(uninterrupted) + batches_as_lists(uninterrupted)  # two epochs

    for k in range(0, 2 * 5 + 1):  # every cut point, including epoch boundaries
        first = PromptDataLoader(data, 4, PAD, seed=3)
        consumed: list = []
        while len(consumed) < k:
            consumed += batches_as_lists(first, limit=k - len(consumed))
        state = first.state_dict()
        resumed = PromptDataLoader(data, 4, PAD, seed=3)
        resumed.load_state_dict(state)
        rest: list = []
        while len(consumed) + len(rest) < len(reference):
            rest += batches_as_lists(resumed)
        assert consumed + rest == reference, f"cut after {k} batches"


def test_state_after_last_batch_moves_to_next_epoch() -> None:
    loader = PromptDataLoader(items(8), 4, PAD, seed=0)
    iterator = iter(loader)
    next(iterator)
    next(iterator)
    state = loader.state_dict()
    assert (state["epoch"], state["batches_done"]) == (0, 2)
    resumed = PromptDataLoader(items(8), 4, PAD, seed=0)
    resumed.load_state_dict(state)
    assert batches_as_lists(resumed) == []  # epoch 0 is done
    assert resumed.epoch == 1
    first_of_epoch1 = batches_as_lists(resumed, limit=1)[0]
    assert first_of_epoch1[1][0].startswith("e1-b0")


def test_resume_refuses_a_different_loader() -> None:
    state = PromptDataLoader(items(8), 4, PAD, seed=0).state_dict()
    with pytest.raises(ValueError, match="dataset_size: saved 8, now 9"):
        PromptDataLoader(items(9), 4, PAD, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="seed: saved 0, now 1"):
        PromptDataLoader(items(8), 4, PAD, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="invalid loader position"):
        PromptDataLoader(items(8), 4, PAD, seed=0).load_state_dict({**state, "batches_done": 5})
