"""Cut one rank's rows into micro-batches: fixed-size (per the Plan) or by token budget (dynamic).

A partition is a list of row-index lists, one per micro-batch. Forward passes concatenate the
micro-batch outputs and put rows back in their original order with `restore_order`.

Dynamic batching (`use_dynamic_bsz`): rows are grouped so that every micro-batch's real tokens
(the sum of its rows' lengths, which is what a trimmed micro-batch costs) stay within the budget,
with the load balanced across micro-batches (`hybridrl.data.balance.balanced_partition`: longest
rows placed first, each into the lightest micro-batch). Megatron's pipeline schedule runs
`num_microbatches` steps in lock-step on all stages, and DP ranks must agree too (the trainer's step
and the loss scaling assume one count), so the count is agreed on over the DP group (the max of what
each rank needs) before the rows are placed.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from hybridrl.data.balance import Partition, balanced_partition
from hybridrl.parallel.device import collective_device

__all__ = ["Partition", "balanced_partition", "dynamic_partition", "fixed_partition", "micro_batches_needed",
           "partition_rows", "restore_order"]


def fixed_partition(num_rows: int, micro_batch_size: int) -> Partition:
    """Consecutive micro-batches of `micro_batch_size` rows (the last may be shorter)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [list(range(start, min(start + micro_batch_size, num_rows)))
            for start in range(0, num_rows, micro_batch_size)]


def micro_batches_needed(lengths: Sequence[int], max_tokens: int) -> int:
    """Fewest balanced micro-batches whose heaviest one fits `max_tokens` (one row per batch at most)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    total = sum(int(n) for n in lengths)
    count = max(1, -(-total // max_tokens))
    while count < len(lengths):
        parts = balanced_partition(lengths, count)
        if max(sum(lengths[r] for r in p) for p in parts) <= max_tokens:
            break
        count += 1
    return min(count, max(1, len(lengths)))


def dynamic_partition(
    lengths: Tensor | Sequence[int], max_tokens: int, dp_group: dist.ProcessGroup | None = None,
    min_parts: int = 1,
) -> Partition:
    """Token-budget micro-batches, the same number on every rank of `dp_group` (a collective).

    A row longer than `max_tokens` gets a micro-batch of its own (it cannot be split). `min_parts`
    raises the count (e.g. to keep a pipeline busy).
    """
    values = [int(n) for n in (lengths.tolist() if isinstance(lengths, Tensor) else lengths)]
    count = max(min_parts, micro_batches_needed(values, max_tokens))
    if dp_group is not None and dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        agreed = torch.tensor([count], dtype=torch.int64, device=collective_device(dp_group))
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=dp_group)
        count = int(agreed.item())
    if count > len(values):
        raise ValueError(
            f"the DP group needs {count} micro-batches but this rank has only {len(values)} rows; "
            "balance the rows per rank or raise the token budget"
        )
    return balanced_partition(values, count)


def restore_order(outputs: Sequence[Tensor], partition: Partition) -> Tensor:
    """Concatenate per-micro-batch outputs (rows in partition order) back into the original row order."""
    order = [row for part in partition for row in part]
    stacked = torch.cat(list(outputs), dim=0)
    if stacked.shape[0] != len(order):
        raise ValueError(f"{stacked.shape[0]} output rows for a partition of {len(order)} rows")
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return stacked.index_select(0, inverse.to(stacked.device))


def partition_rows(
    attention_mask: Tensor, micro_batch_size: int, *, dynamic: bool = False, max_tokens: int = 0,
    dp_group: dist.ProcessGroup | None = None,
) -> Partition:
    """Fixed `micro_batch_size` micro-batches, or (`dynamic`) token-budget ones agreed over `dp_group`."""
    if not dynamic:
        return fixed_partition(int(attention_mask.shape[0]), micro_batch_size)
    return dynamic_partition((attention_mask != 0).sum(-1), max_tokens, dp_group)
