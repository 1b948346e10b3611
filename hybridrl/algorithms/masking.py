"""Masked reductions over token tensors.

Conventions shared by the whole package: token tensors are `[B, T]`; a mask is bool or float of the
same shape (a float mask is a per-token weight, 0 meaning "not a token"). Values at masked
positions are never read: they are replaced by 0 with `torch.where` rather than multiplied by the
mask, so garbage there (-inf log-probs of padding, NaN) cannot leak into results.
"""
from __future__ import annotations

import torch
from torch import Tensor


def masked_fill_zero(x: Tensor, mask: Tensor) -> Tensor:
    """`x * mask` where mask != 0, exactly 0 elsewhere (whatever `x` holds there)."""
    weights = mask.to(x.dtype)
    return torch.where(weights != 0, x * weights, torch.zeros((), dtype=x.dtype, device=x.device))


def nonzero_or_one(count: Tensor | float | int) -> Tensor | float | int:
    """`count` with zeros replaced by 1: dividing a masked sum (0 when the count is 0) by it gives 0."""
    if isinstance(count, Tensor):
        return torch.where(count == 0, torch.ones_like(count), count)
    return count if count != 0 else 1


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of the unmasked entries of `x`, over `dim` (all entries when None)."""
    filled = masked_fill_zero(x, mask)
    return filled.sum() if dim is None else filled.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of the unmasked entries of `x` (weighted by a float mask), over `dim` or all entries.

    An empty slice (mask all 0) has mean 0, not NaN, so an empty row does not poison a batch.
    """
    weights = mask.to(x.dtype)
    count = weights.sum() if dim is None else weights.sum(dim)
    return masked_sum(x, mask, dim) / nonzero_or_one(count)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the unmasked entries of `x` (all of them together, a 0-dim tensor).

    `unbiased` divides by (n - 1) (Bessel). With n = 0, or n = 1 when unbiased, the variance is
    undefined; we return 0 (the squared deviations sum to 0 there) instead of raising, because a
    device sync to check n would cost more than the corner case is worth.
    """
    mean = masked_mean(x, mask)
    squared_dev = masked_sum((x - mean) ** 2, mask)
    count = mask.to(x.dtype).sum()
    if unbiased:
        count = count - 1
    return squared_dev / torch.clamp(count, min=1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalize the unmasked entries of `x` to unit (unbiased) variance; masked entries become 0.

    Statistics are taken over all unmasked entries of the whole tensor (the batch), not per row.
    `shift_mean=False` keeps the original mean (scales only around it).
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return masked_fill_zero(whitened, (mask != 0).to(x.dtype))
