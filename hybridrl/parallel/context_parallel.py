"""Context parallelism's sequence layout: which columns a CP rank holds, and gathering them back.

megatron's load-balanced order (its `get_batch_on_this_cp_rank`, and `get_pos_emb_on_this_cp_rank`
for the rotary table): a sequence of `s` columns is cut into `2 * cp` equal chunks and CP rank `r`
holds chunks `r` and `2 * cp - 1 - r`, in that order. Under a causal mask a late chunk costs more
than an early one; pairing the i-th earliest with the i-th latest gives every rank the same work.
So `s` must be a multiple of `2 * cp` (the training backend pads micro-batches to it).

`gather_from_cp` is the one collective the CPU path needs in both directions: all-gather along the
sequence, put back in global order; its backward sums the gradient over the CP ranks and keeps this
rank's columns (the adjoint of an all-gather, a reduce-scatter). Every consumer that computes the
same function of gathered tensors on each CP rank (the attention stand-in's keys and values, the
backend's final hidden states) therefore gets the gradient of the *sum* of the CP ranks'
objectives, which the caller accounts for (`hybridrl.training.mini_batch`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def cp_columns(seq_len: int, cp: int, rank: int, device: Any = None) -> torch.Tensor:
    """The global columns CP rank `rank` holds, in its local order (chunks r and 2cp-1-r)."""
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} of {cp}")
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} columns does not cut into 2 × CP = {2 * cp} equal chunks")
    chunk = seq_len // (2 * cp)
    starts = (rank * chunk, (2 * cp - 1 - rank) * chunk)
    return torch.cat([torch.arange(a, a + chunk, device=device) for a in starts])


def split_for_cp_rank(tensor: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """This CP rank's columns of `tensor` along `dim` (megatron's load-balanced order)."""
    if cp == 1:
        return tensor
    return tensor.index_select(dim, cp_columns(tensor.shape[dim], cp, rank, tensor.device))


def _global_order(local_len: int, cp: int, device: Any) -> torch.Tensor:
    """Where each global column sits in the rank-major concatenation of the CP ranks' local tensors."""
    rank_major = torch.cat([cp_columns(local_len * cp, cp, r, device) for r in range(cp)])
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


def gather_from_cp(tensor: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """The whole sequence from every CP rank's columns of it (`dim`), in global column order.

    Autograd-correct: the backward is a reduce-scatter of the gradient (module docstring)."""
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    gathered = _GatherSequence.apply(tensor, dim, group)
    return gathered.index_select(dim, _global_order(tensor.shape[dim], size, tensor.device))
