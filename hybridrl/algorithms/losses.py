"""PPO clipped policy loss (with dual clip) and clipped value loss.

Both take `[B, T]` tensors and a `response_mask`, build a per-token loss and reduce it with
`aggregate_loss`; the `global_tokens` / `global_seqs` / `norm_length` / `seq_token_counts`
arguments pass straight through to it, so the losses are split-invariant (see `hybridrl.algorithms.aggregation`).
Metrics are detached 0-dim tensors (no device sync here), averaged over this batch's tokens.
"""
from __future__ import annotations

import torch
from torch import Tensor

from hybridrl.algorithms.aggregation import Count, aggregate_loss
from hybridrl.algorithms.masking import masked_mean

# Log-ratios beyond this cannot be meant; exp(20) ~ 4.9e8 is still finite in float32 and bf16.
LOG_RATIO_BOUND = 20.0


def ppo_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = 3.0,
    agg: str = "token-mean",
    *,
    global_tokens: Count | None = None,
    global_seqs: Count | None = None,
    norm_length: float | None = None,
    seq_token_counts: Tensor | None = None,
    token_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate loss of PPO (Schulman et al. 2017) with the dual clip of Ye et al. 2020.

    Per token, with ratio = exp(log_prob - old_log_prob) and A the advantage:
        clipped = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
        loss    = min(clipped, -A * dual_clip)   if A < 0 and dual_clip is not None
                  clipped                          otherwise
    Asymmetric `clip_high` > `clip_low` is DAPO's clip-higher. The dual clip bounds the loss of a
    token whose ratio exploded while its advantage is negative. The log-ratio is clamped to
    [-20, 20] before exp, so extreme inputs give finite losses and gradients.

    `token_weight` `[B, T]` (optional, detached) multiplies each token's loss after the clips and
    before aggregation, with the normalizers unchanged: the rollout-mismatch correction's TIS
    weights and MIS mask (`hybridrl.algorithms.rollout_correction`). The metrics ignore it.

    Args: `log_prob` (with grad), `old_log_prob`, `advantages`, `response_mask` are `[B, T]`.
    Returns: `(loss, metrics)`; metrics: `clipfrac` (share of tokens where the ratio clip is
    active), `clipfrac_lower` (share where the dual clip is active), `approx_kl` (mean of
    old_log_prob - log_prob, the k1 estimate of KL(old || new)), `ratio_mean`, `ratio_max`.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to disable it), got {dual_clip}")
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")

    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    token_loss = torch.maximum(unclipped_loss, clipped_loss)
    ratio_clipped = clipped_loss > unclipped_loss

    if dual_clip is not None:
        dual_bound = -advantages * dual_clip
        negative = advantages < 0
        dual_clipped = negative & (token_loss > dual_bound)
        token_loss = torch.where(negative, torch.minimum(token_loss, dual_bound), token_loss)
    else:
        dual_clipped = torch.zeros_like(ratio_clipped)

    if token_weight is not None:
        if token_weight.shape != token_loss.shape:
            raise ValueError(f"token_weight {tuple(token_weight.shape)} must have the loss's shape "
                             f"{tuple(token_loss.shape)}")
        token_loss = token_loss * token_weight.detach().to(token_loss.dtype)
    loss = aggregate_loss(token_loss, response_mask, agg, global_tokens=global_tokens, global_seqs=global_seqs,
                          norm_length=norm_length, seq_token_counts=seq_token_counts)
    with torch.no_grad():
        valid = response_mask != 0
        metrics = {
            "clipfrac": masked_mean(ratio_clipped.to(ratio.dtype), valid),
            "clipfrac_lower": masked_mean(dual_clipped.to(ratio.dtype), valid),
            "approx_kl": masked_mean(-log_ratio, valid),
            "ratio_mean": masked_mean(ratio, valid),
            "ratio_max": torch.where(valid, ratio, torch.zeros_like(ratio)).max()
            if ratio.numel() else ratio.new_zeros(()),
        }
    return loss, {name: value.detach() for name, value in metrics.items()}


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    clip: float | None,
    agg: str = "token-mean",
    *,
    global_tokens: Count | None = None,
    global_seqs: Count | None = None,
    norm_length: float | None = None,
    seq_token_counts: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss: per token 0.5 * max((v - R)^2, (old_v + clip(v - old_v, -clip, clip) - R)^2).

    `clip=None` disables clipping (plain 0.5 * (v - R)^2). All inputs `[B, T]`.
    Returns `(loss, metrics)`; metrics: `clipfrac` (share of tokens where the clipped term is the
    larger), `vpred_mean`, `value_error` (mean squared error of the unclipped values).
    """
    unclipped = (values - returns).square()
    if clip is None:
        token_loss = 0.5 * unclipped
        clipped_wins = torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        if clip < 0:
            raise ValueError(f"value clip must be >= 0 (or None), got {clip}")
        values_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        clipped = (values_clipped - returns).square()
        token_loss = 0.5 * torch.maximum(unclipped, clipped)
        clipped_wins = clipped > unclipped

    loss = aggregate_loss(token_loss, response_mask, agg, global_tokens=global_tokens, global_seqs=global_seqs,
                          norm_length=norm_length, seq_token_counts=seq_token_counts)
    with torch.no_grad():
        valid = response_mask != 0
        metrics = {
            "clipfrac": masked_mean(clipped_wins.to(values.dtype), valid),
            "vpred_mean": masked_mean(values, valid),
            "value_error": masked_mean(unclipped, valid),
        }
    return loss, {name: value.detach() for name, value in metrics.items()}
