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

Shared prompts (`model.shared_prefix`): a micro-batch computes a prompt once for all of its rows that
share it, so a token budget counts a group's prompt once and its rows' responses each
(`shared_dynamic_partition`): the rows of a prompt group stay in one micro-batch, a group is cut only
where its prompt plus its responses would pass the budget. Fixed-size micro-batches stay consecutive
rows (the controller dispatches a prompt's rows next to each other): a micro-batch size that is a
multiple of `rollout.n` keeps every group whole, another size shares what lands together.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from hybridrl.data.balance import Partition, balanced_partition
from hybridrl.parallel.device import collective_device

__all__ = ["Partition", "balanced_partition", "dynamic_partition", "fixed_partition", "micro_batches_needed",
           "partition_rows", "restore_order", "shared_dynamic_partition"]


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
    count = _agreed_count(max(min_parts, micro_batches_needed(values, max_tokens)), dp_group)
    if count > len(values):
        raise ValueError(
            f"the DP group needs {count} micro-batches but this rank has only {len(values)} rows; "
            "balance the rows per rank or raise the token budget"
        )
    return balanced_partition(values, count)


def _agreed_count(count: int, dp_group: dist.ProcessGroup | None) -> int:
    """The largest of the DP group's micro-batch counts (a collective), `count` without a group."""
    if dp_group is not None and dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        agreed = torch.tensor([count], dtype=torch.int64, device=collective_device(dp_group))
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=dp_group)
        count = int(agreed.item())
    return count


def shared_dynamic_partition(
    lengths: Sequence[int], prompt_lengths: Sequence[int], groups: Sequence[Sequence[int]], max_tokens: int,
    dp_group: dist.ProcessGroup | None = None,
) -> Partition:
    """Token-budget micro-batches when rows sharing a prompt compute it once (module docstring): each of
    `groups` (rows with one prompt, `prompt_lengths[row]` tokens of each row's `lengths[row]`) costs its
    prompt once plus its rows' responses; a group over `max_tokens` is cut into runs that fit (a row
    over it alone), and when the DP group needs more micro-batches than this rank has runs, the run with
    the most rows is halved until there are enough. The count is agreed over `dp_group` (a collective).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    units: list[list[int]] = []
    for group in groups:
        prompt = int(prompt_lengths[group[0]])
        run: list[int] = []
        cost = prompt
        for row in group:
            extra = int(lengths[row]) - prompt
            if run and cost + extra > max_tokens:
                units.append(run)
                run, cost = [], prompt
            run.append(int(row))
            cost += extra
        units.append(run)

    def cost_of(unit: list[int]) -> int:
        return int(prompt_lengths[unit[0]]) + sum(int(lengths[r]) - int(prompt_lengths[r]) for r in unit)

    count = _agreed_count(micro_batches_needed([cost_of(u) for u in units], max_tokens), dp_group)
    while count > len(units):
        widest = max(range(len(units)), key=lambda i: (len(units[i]), cost_of(units[i])))
        if len(units[widest]) == 1:
            raise ValueError(f"the DP group needs {count} micro-batches but this rank has only {len(units)} rows; "
                             "balance the rows per rank or raise the token budget")
        half = len(units[widest]) // 2
        units[widest:widest + 1] = [units[widest][:half], units[widest][half:]]
    parts = balanced_partition([cost_of(u) for u in units], count)
    return [sorted(row for unit in part for row in units[unit]) for part in parts]


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
    dp_group: dist.ProcessGroup | None = None, prompt_groups: Sequence[Sequence[int]] | None = None,
    prompt_width: int = 0,
) -> Partition:
    """Fixed `micro_batch_size` micro-batches, or (`dynamic`) token-budget ones agreed over `dp_group`;
    with `prompt_groups` (rows sharing a prompt, which micro-batches compute once; the prompts are the first
    `prompt_width` columns) the budget counts each group's prompt once (`shared_dynamic_partition`)."""
    if not dynamic:
        return fixed_partition(int(attention_mask.shape[0]), micro_batch_size)
    lengths = (attention_mask != 0).sum(-1)
    if prompt_groups is None:
        return dynamic_partition(lengths, max_tokens, dp_group)
    prompt_lengths = (attention_mask[:, :prompt_width] != 0).sum(-1)
    return shared_dynamic_partition(lengths.tolist(), prompt_lengths.tolist(), prompt_groups, max_tokens, dp_group)
