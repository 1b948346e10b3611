"""A `PromptDataLoader`'s saved state and the rule for resuming from it, torch-free.

The loader checks a saved state against itself when it resumes (`PromptDataLoader.load_state_dict`);
`hybridrl plan` checks a checkpoint's saved state against the job's config with the same
`state_mismatches` before any process starts (`hybridrl.config.resume`), so both refuse alike.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["CHECKED_FIELDS", "LoaderState", "state_mismatches"]


@dataclass(frozen=True)
class LoaderState:
    """Everything needed to resume: the order is recomputed from (seed, epoch)."""

    epoch: int
    batches_done: int  # batches of `epoch` already handed out
    seed: int
    # Checked on resume: a different dataset or batch size would silently change the order.
    dataset_size: int
    batch_size: int
    shuffle: bool
    drop_last: bool


# The fields a resume must find unchanged (the position fields, epoch and batches_done, are what it restores).
CHECKED_FIELDS = tuple(f.name for f in fields(LoaderState) if f.name not in ("epoch", "batches_done"))


def state_mismatches(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, saved value, current value) of every checked field that differs between a saved loader state and
    the loader about to resume it. A field `current` does not hold is not known there and not compared (the plan
    knows a dataset's size only when no prompt can be filtered out)."""
    return [(name, saved.get(name), current[name]) for name in CHECKED_FIELDS
            if name in current and saved.get(name) != current[name]]
