"""Batches of prompts: left-padded collation into a `Batch`, and a resumable, deterministic loader.

Order. Epoch e visits the dataset in the permutation drawn from ``numpy.random.default_rng([seed, e])``
(or in file order when ``shuffle`` is off). The order is a pure function of (seed, epoch), so the
loader's whole state is (epoch, batches already handed out in it): `state_dict()` is three numbers,
and `load_state_dict()` resumes mid-epoch exactly, on any machine, without replaying the data.

Batch size. Training batches always hold exactly ``batch_size`` prompts (``drop_last=True``, the
default): the step arithmetic (``train_batch_size`` split over mini-batches and data-parallel ranks)
needs a fixed size, and the few prompts left over at the end of an epoch are seen in other epochs
because the order is reshuffled (without shuffling the same last ones are never seen: `left_out_note`, which the
trainer logs). Validation uses ``drop_last=False, shuffle=False`` so every prompt
is scored once; its last batch may be smaller.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from hybridrl.data.batch import Batch
from hybridrl.data.dataset import PromptItem
from hybridrl.data.loader_state import LoaderState, state_mismatches


def collate_prompts(
    items: Sequence[PromptItem],
    pad_token_id: int,
    uids: Sequence[str] | None = None,
    pad_to_length: int | None = None,
) -> Batch:
    """Left-pad prompts into ``input_ids``/``attention_mask``/``position_ids`` [B, P] plus metadata.

    Left padding puts every prompt's last token in the last column, so generation appends responses
    at the same column for all rows. ``position_ids`` count real tokens only (0 at the first real
    token; pad positions are 0) so a padded prompt gets the same positions as an unpadded one.
    ``P`` is the longest prompt, or ``pad_to_length`` when given (fixed shapes for compiled paths).

    Non-tensor columns: ``uid`` (one per prompt: the GRPO group key once responses are sampled),
    ``index``, ``data_source``, ``ground_truth``, ``reward_spec``, ``raw_prompt`` (the templated
    text), ``extra_info``.
    """
    if not items:
        raise ValueError("cannot collate an empty list of prompts")
    lengths = [len(item.input_ids) for item in items]
    width = max(lengths)
    if pad_to_length is not None:
        if pad_to_length < width:
            raise ValueError(f"pad_to_length={pad_to_length} is shorter than the longest prompt ({width} tokens)")
        width = pad_to_length
    input_ids = torch.full((len(items), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, (item, length) in enumerate(zip(items, lengths)):
        input_ids[row, width - length:] = torch.tensor(item.input_ids, dtype=torch.long)
        attention_mask[row, width - length:] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    if uids is None:
        uids = [f"prompt-{item.index}-{row}" for row, item in enumerate(items)]
    if len(uids) != len(items):
        raise ValueError(f"{len(uids)} uids for {len(items)} prompts")
    if len(set(uids)) != len(uids):
        raise ValueError("uids must be unique within a batch (they key the GRPO groups)")
    return Batch(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
        non_tensors={
            "uid": np.array(list(uids), dtype=object),
            "index": np.array([item.index for item in items], dtype=np.int64),
            "data_source": [item.data_source for item in items],
            "ground_truth": [item.ground_truth for item in items],
            "reward_spec": [item.reward_spec for item in items],
            "raw_prompt": [item.prompt_text for item in items],
            "extra_info": [item.extra_info for item in items],
        },
    )


def unpadded_prompt_ids(batch: Batch) -> list[list[int]]:
    """Each row's prompt token ids without the left padding (what a rollout engine takes)."""
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    return [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]


class PromptDataLoader:
    """Deterministic, resumable batches of a `PromptDataset` (see the module docstring).

    Iterating yields the remaining batches of the current epoch as `Batch` objects, then moves to the
    next epoch: ``for epoch in range(n): for batch in loader: ...``. `state_dict()` taken after
    receiving k batches resumes at batch k + 1.
    """

    def __init__(
        self,
        dataset: Sequence[PromptItem],
        batch_size: int,
        pad_token_id: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        pad_to_length: int | None = None,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if drop_last and len(dataset) < batch_size:
            raise ValueError(
                f"the dataset has {len(dataset)} prompts, fewer than one batch of {batch_size}: "
                "no batch would ever be produced (lower the batch size or add data)"
            )
        if len(dataset) == 0:
            raise ValueError("the dataset is empty")
        self.dataset = dataset
        self.batch_size = batch_size
        self.pad_token_id = pad_token_id
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pad_to_length = pad_to_length
        self._epoch = 0
        self._batches_done = 0

    # ---------------------------------------------------------------------------- order
    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    @property
    def epoch(self) -> int:
        return self._epoch

    def left_out_note(self) -> str | None:
        """What each epoch leaves out of a fixed-size batching (`drop_last`), for the log; None when nothing is: with
        shuffling a different remainder each epoch, without it the same last prompts, never trained on."""
        left = len(self.dataset) % self.batch_size if self.drop_last else 0
        if not left:
            return None
        share = f"{left} of the {len(self.dataset)} prompts (not a multiple of the batch size {self.batch_size})"
        if self.shuffle:
            return f"each epoch leaves out {share}, a different {left} each epoch"
        return f"every epoch leaves out the same {share}, the last ones in file order: they are never trained on"

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Dataset positions in the order epoch `epoch` visits them."""
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def batch_positions(self, epoch: int, batch: int) -> np.ndarray:
        start = batch * self.batch_size
        return self.epoch_order(epoch)[start:start + self.batch_size]

    # ---------------------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[Batch]:
        epoch = self._epoch
        order = self.epoch_order(epoch)
        while self._batches_done < len(self):
            batch_index = self._batches_done
            positions = order[batch_index * self.batch_size:(batch_index + 1) * self.batch_size]
            items = [self.dataset[int(p)] for p in positions]
            # Deterministic uids: a resumed run labels its groups exactly like the uninterrupted one.
            uids = [f"e{epoch}-b{batch_index}-{row}" for row in range(len(items))]
            batch = collate_prompts(items, self.pad_token_id, uids=uids, pad_to_length=self.pad_to_length)
            batch.meta.update({"epoch": epoch, "batch_index": batch_index})
            # Count before yielding: a state saved right after receiving this batch must skip it.
            self._batches_done += 1
            yield batch
        self._epoch = epoch + 1
        self._batches_done = 0

    # ---------------------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        return asdict(
            LoaderState(
                epoch=self._epoch,
                batches_done=self._batches_done,
                seed=self.seed,
                dataset_size=len(self.dataset),
                batch_size=self.batch_size,
                shuffle=self.shuffle,
                drop_last=self.drop_last,
            )
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = LoaderState(**state)
        mismatches = [f"{name}: saved {was!r}, now {now!r}"
                      for name, was, now in state_mismatches(state, self.state_dict())]
        if mismatches:
            raise ValueError(
                "the saved data loader state does not match this loader, so resuming would visit "
                "different prompts: " + "; ".join(mismatches)
            )
        if not 0 <= saved.batches_done <= len(self) or saved.epoch < 0:
            raise ValueError(f"invalid loader position: epoch {saved.epoch}, batch {saved.batches_done}")
        self._epoch = saved.epoch
        self._batches_done = saved.batches_done
