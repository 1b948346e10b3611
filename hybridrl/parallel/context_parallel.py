"""Context parallelism's sequence layout: which columns a CP rank holds, and gathering them back.

megatron's load-balanced order (its `get_batch_on_this_cp_rank`, and `get_pos_emb_on_this_cp_rank`
for the rotary table): a sequence of `s` columns is cut into `2 * cp` equal chunks and CP rank `r`
holds chunks `r` and `2 * cp - 1 - r`, in that order. Under a causal mask a late chunk costs more
than an early one; pairing the i-th earliest with the i-th latest gives every rank the same work.
So `s` must be a multiple of `2 * cp` (the training backend pads micro-batches to it).

A packed (THD) sequence is cut the same way segment by segment (TransformerEngine's
`thd_get_partitioned_indices`, which megatron's `get_thd_batch_on_this_cp_rank` calls): every
segment (a row, padded to a multiple of `2 * cp`) is cut into `2 * cp` chunks and rank `r` holds
chunks `r` and `2 * cp - 1 - r` of each, segment after segment. `bounds` names the segments: a
packed micro-batch's `cu_seqlens`, or `[0, s]` for a padded one (each row one segment of `s`).

`gather_from_cp` is the one collective the CPU path needs in both directions: all-gather along the
sequence, put back in global order; its backward sums the gradient over the CP ranks and keeps this
rank's columns (the adjoint of an all-gather, a reduce-scatter). Every consumer that computes the
same function of gathered tensors on each CP rank (the attention stand-in's keys and values, the
backend's final hidden states) therefore gets the gradient of the *sum* of the CP ranks'
objectives, which the caller accounts for (`hybridrl.training.mini_batch`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def cp_columns(bounds: Sequence[int], cp: int, rank: int, device: Any = None) -> torch.Tensor:
    """The global columns CP rank `rank` holds, in its local order: chunks r and 2cp-1-r of each
    segment `[bounds[i], bounds[i + 1])`, segment after segment (`[0, s]`: one sequence of `s`)."""
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} of {cp}")
    bounds = [int(b) for b in bounds]
    if len(bounds) < 2 or bounds[0] != 0:
        raise ValueError(f"segment bounds {bounds[:4]} must start at 0 and name at least one segment")
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end < start or (end - start) % (2 * cp):
            raise ValueError(f"a segment of {end - start} columns (at {start}) does not cut into 2 × CP = "
                             f"{2 * cp} equal chunks")
        chunk = (end - start) // (2 * cp)
        for first in (start + rank * chunk, start + (2 * cp - 1 - rank) * chunk):
            pieces.append(torch.arange(first, first + chunk, device=device))
    return torch.cat(pieces)


def split_for_cp_rank(tensor: torch.Tensor, dim: int, cp: int, rank: int,
                      bounds: Sequence[int] | None = None) -> torch.Tensor:
    """This CP rank's columns of `tensor` along `dim` (megatron's load-balanced order; `bounds`: the
    packed segments, default one sequence of the whole length)."""
    if cp == 1:
        return tensor
    bounds = [0, tensor.shape[dim]] if bounds is None else bounds
    return tensor.index_select(dim, cp_columns(bounds, cp, rank, tensor.device))


def _global_order(bounds: Sequence[int], cp: int, device: Any) -> torch.Tensor:
    """Where each global column sits in the rank-major concatenation of the CP ranks' local tensors."""
    rank_major = torch.cat([cp_columns(bounds, cp, r, device) for r in range(cp)])
    return torch.argsort(rank_major)


class _GatherSequence(torch.autograd.Function):
    """all-gather along `dim` over `group` (rank-major); backward: sum over the group, keep this rank's part."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, dim: int, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.dim, ctx.group = dim, group
        ctx.rank, ctx.size, ctx.local = dist.get_rank(group), dist.get_world_size(group), tensor.shape[dim]
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(ctx.size)]
        dist.all_gather(parts, tensor, group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        # gloo has no reduce-scatter: an all-reduce, then this rank's slice, is the same sum.
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == dist.Backend.GLOO:
            dist.all_reduce(grad, group=ctx.group)
            return grad.narrow(ctx.dim, ctx.rank * ctx.local, ctx.local).contiguous(), None, None
        moved = grad.movedim(ctx.dim, 0).contiguous()
        out = moved.new_empty((ctx.local, *moved.shape[1:]))
        dist.reduce_scatter_tensor(out, moved, group=ctx.group)
        return out.movedim(0, ctx.dim).contiguous(), None, None


def gather_from_cp(tensor: torch.Tensor, dim: int, group: Any, bounds: Sequence[int] | None = None) -> torch.Tensor:
    """The whole sequence from every CP rank's columns of it (`dim`), in global column order (`bounds`:
    the packed segments, as `split_for_cp_rank` took them; default one sequence).

    Autograd-correct: the backward is a reduce-scatter of the gradient (module docstring)."""
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    bounds = [0, tensor.shape[dim] * size] if bounds is None else bounds
    if int(bounds[-1]) != tensor.shape[dim] * size:
        raise ValueError(f"segments ending at {int(bounds[-1])} columns, gathered from {size} CP ranks of "
                         f"{tensor.shape[dim]} columns each")
    gathered = _GatherSequence.apply(tensor, dim, group)
    return gathered.index_select(dim, _global_order(bounds, size, tensor.device))
