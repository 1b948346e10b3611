"""Reduce a `[B, T]` per-token loss to a scalar, identically however the mini-batch is cut.

Modes (m = mask weights, L = per-token loss, S = sequences with at least one unmasked token,
N = sum of m over the mini-batch, T_norm = a constant length):
    token-mean               sum_{i,t} m L / N
    token-sum                sum_{i,t} m L
    seq-mean-token-sum       sum_i (sum_t m L) / S
    seq-mean-token-mean      sum_i (sum_t m L / sum_t m) / S
    seq-mean-token-sum-norm  sum_i (sum_t m L) / (S * T_norm)     (Dr.GRPO's constant normalizer)
Rows whose mask is all 0 (e.g. padding rows added to make a batch divisible) count neither as
tokens nor as sequences: adding them never changes the loss.

Split invariance. Every mode is a sum over sequences divided by a mini-batch constant (N, S or
S * T_norm), so it splits exactly: compute N and S once for the *whole mini-batch* (all
micro-batches on all DP ranks: `global_loss_normalizers`), pass them as `global_tokens` /
`global_seqs` to every micro-batch's `aggregate_loss`, and the sum of the micro-batch losses over
micro-batches and DP ranks equals the mini-batch loss computed at once -- so do the gradients.
`norm_length` must be the same constant everywhere (e.g. the configured max response length);
its default, the mask's T, is only safe when every micro-batch is padded to the same T.

Context parallelism splits each sequence's tokens over CP ranks. The sum over CP ranks of their
losses is again the micro-batch loss provided (a) N and S are counted on the complete sequences
(before the split) and (b) for `seq-mean-token-mean`, each sequence's own token count is passed
as `seq_token_counts` (a CP rank sees only its part of the row).

Scaling for workers. The target gradient is the gradient of that *sum*. Frameworks average
instead of summing, and the worker must undo it by scaling the micro-batch loss it hands them:
  * Megatron DDP averages gradients over the data-parallel group (divides by dp_size): multiply
    by dp_size.
  * Megatron's `forward_backward_func` divides a loss returned as `(loss, metrics)` by
    num_microbatches (and multiplies it by the context-parallel size, which the 1/(dp*cp) of the
    gradient reduction over the dp x cp group cancels): multiply by num_microbatches.
  So with megatron schedules + DDP, return `aggregate_loss(...) * num_microbatches * dp_size`
  from the loss function, and log the unscaled value. With a plain loop of `loss.backward()` per
  micro-batch and a summing all-reduce, no scaling is needed.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from hybridrl.algorithms.masking import masked_sum, nonzero_or_one
from hybridrl.algorithms.names import LOSS_AGG_MODES, unknown_name_message

Count = Tensor | float | int


def aggregate_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    *,
    global_tokens: Count | None = None,
    global_seqs: Count | None = None,
    norm_length: float | None = None,
    seq_token_counts: Tensor | None = None,
) -> Tensor:
    """Reduce `loss_mat` `[B, T]` under `mask` (bool or float weights, `[B, T]`) by `mode`.

    `global_tokens` (N) and `global_seqs` (S) default to this batch's own counts; pass the
    mini-batch totals (see the module docstring) when this batch is one micro-batch of many.
    `norm_length` (T_norm for `seq-mean-token-sum-norm`) defaults to `mask.shape[-1]`.
    `seq_token_counts` `[B]` (for `seq-mean-token-mean`) defaults to the row sums of `mask`.
    Empty input (no unmasked token) gives a loss of 0. The result has the dtype of `loss_mat`
    promoted to at least float32 (counts lose precision in bf16).
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(unknown_name_message("loss aggregation mode", mode, LOSS_AGG_MODES))
    if loss_mat.shape != mask.shape or loss_mat.dim() != 2:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} must both be [B, T]")

    loss_mat = loss_mat.to(torch.promote_types(loss_mat.dtype, torch.float32))
    if mode == "token-sum":
        return masked_sum(loss_mat, mask)
    if mode == "token-mean":
        tokens = mask.to(loss_mat.dtype).sum() if global_tokens is None else global_tokens
        return masked_sum(loss_mat, mask) / _divisor(tokens, loss_mat)

    seqs = _divisor(count_sequences(mask) if global_seqs is None else global_seqs, loss_mat)
    seq_sums = masked_sum(loss_mat, mask, dim=-1)
    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / seqs
    if mode == "seq-mean-token-mean":
        if seq_token_counts is None:
            seq_lengths = mask.to(loss_mat.dtype).sum(-1)
        else:
            seq_lengths = seq_token_counts.to(dtype=loss_mat.dtype, device=loss_mat.device)
        return (seq_sums / nonzero_or_one(seq_lengths)).sum() / seqs
    # seq-mean-token-sum-norm
    length = mask.shape[-1] if norm_length is None else norm_length
    if length <= 0:
        raise ValueError(f"norm_length must be positive, got {length}")
    return seq_sums.sum() / (seqs * length)


def count_sequences(mask: Tensor) -> Tensor:
    """Number of rows of `mask` `[B, T]` with at least one unmasked token (a float64 0-dim tensor)."""
    return (mask != 0).any(dim=-1).sum().to(torch.float64)


def _divisor(count: Count, like: Tensor) -> Tensor | float | int:
    # Counts arrive as float64 (exact beyond 2**24 tokens); divide in the loss's dtype so the loss
    # is not silently promoted to float64.
    if isinstance(count, Tensor):
        count = count.to(dtype=like.dtype, device=like.device)
    return nonzero_or_one(count)


@dataclass(frozen=True)
class LossNormalizers:
    """Mini-batch constants for `aggregate_loss`: N (`tokens`, mask-weight sum) and S (`seqs`)."""

    tokens: Tensor
    seqs: Tensor

    def as_kwargs(self) -> dict[str, Tensor]:
        """`aggregate_loss(..., **normalizers.as_kwargs())`."""
        return {"global_tokens": self.tokens, "global_seqs": self.seqs}


def count_loss_normalizers(mask: Tensor) -> LossNormalizers:
    """The normalizers of one batch's `mask` `[B, T]` (float64 0-dim tensors on its device; float64
    keeps token counts exact past 2**24)."""
    return LossNormalizers(tokens=mask.to(torch.float64).sum(), seqs=count_sequences(mask))


def global_loss_normalizers(
    micro_batch_masks: Iterable[Tensor], dp_group: dist.ProcessGroup | None = None
) -> LossNormalizers:
    """Normalizers of a whole mini-batch: summed over this rank's micro-batch masks, then
    all-reduced (sum) over `dp_group` when torch.distributed is initialized and `dp_group` is given.

    Every rank of `dp_group` must call this (it is a collective) with the masks of its share of the
    same mini-batch. Call it once per mini-batch, before the first micro-batch's forward.
    """
    totals: Tensor | None = None
    for mask in micro_batch_masks:
        counts = count_loss_normalizers(mask)
        pair = torch.stack([counts.tokens, counts.seqs])
        totals = pair if totals is None else totals + pair
    if totals is None:
        raise ValueError("global_loss_normalizers needs at least one micro-batch mask")
    if dp_group is not None and dist.is_initialized():
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=dp_group)
    return LossNormalizers(tokens=totals[0], seqs=totals[1])
