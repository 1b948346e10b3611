"""Rollout-mismatch correction: truncated importance sampling (TIS) and masked IS (MIS).

The responses were sampled by the rollout engine (vLLM), whose per-token log-probs are the behaviour
policy mu; PPO's ratio is taken against the trainer's old policy pi_old. The two differ by numerics
(kernels, dtypes), by a weight sync gone wrong or, with asynchronous rollouts, by staleness. The
importance ratio of a token is rho = pi_old(y) / mu(y), in log space `target - rollout`:

    token level      log w_t = log rho_t
    sequence level   log w_t = sum_s log rho_s over the sequence's response tokens (the same weight
                     for every token of the sequence: the product of the ratios)
    geometric        (masking only) the sequence's mean log rho: the geometric mean of its ratios

TIS multiplies each token's policy-gradient loss by w = min(rho, C) (a detached weight: it corrects
the sampling distribution, it is not optimised). MIS multiplies it by 0 where rho (token, sequence
or geometric) leaves the band [low, high] and by 1 elsewhere; both together multiply. The masked
tokens still count in the loss normalizers (N tokens, S sequences of `aggregate_loss`): the loss
keeps its scale whatever share is masked, and the mini-batch constants (and so split invariance) are
those of the uncorrected loss.

With top-k/top-p sampling the target must be computed under the same truncation
(`hybridrl.algorithms.truncation`, `algorithm.rollout_correction.match_truncation`): vLLM's log-probs
are of the truncated, renormalized distribution.

Log-ratios are clamped to [-20, 20] per token before they are summed (as PPO's ratio is), so a
token vLLM scored -inf cannot make the weights NaN. Padding positions carry weight 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from hybridrl.algorithms.losses import LOG_RATIO_BOUND  # the same bound as PPO's log-ratio
from hybridrl.algorithms.names import ROLLOUT_IS_LEVELS, ROLLOUT_MASK_LEVELS, unknown_name_message


@dataclass(frozen=True)
class RolloutCorrection:
    """What to correct: `is_level` (none, token, sequence) with cap `is_cap`; `mask_level` (none,
    token, sequence, geometric) with the band [`mask_low`, `mask_high`] of kept ratios."""

    is_level: str = "none"
    is_cap: float = 2.0
    mask_level: str = "none"
    mask_low: float = 0.5
    mask_high: float = 2.0

    def __post_init__(self) -> None:
        if self.is_level not in ROLLOUT_IS_LEVELS:
            raise ValueError(unknown_name_message("rollout IS level", self.is_level, ROLLOUT_IS_LEVELS))
        if self.mask_level not in ROLLOUT_MASK_LEVELS:
            raise ValueError(unknown_name_message("rollout mask level", self.mask_level, ROLLOUT_MASK_LEVELS))
        if not self.is_cap > 0:
            raise ValueError(f"is_cap must be > 0, got {self.is_cap}")
        if not 0 <= self.mask_low < self.mask_high:
            raise ValueError(f"the mask band needs 0 <= mask_low < mask_high, got [{self.mask_low}, {self.mask_high}]")

    @property
    def enabled(self) -> bool:
        return self.is_level != "none" or self.mask_level != "none"


@dataclass(frozen=True)
class CorrectionResult:
    """`token_weight` `[B, T]`: the factor on each token's PG loss (IS weight x keep mask, detached,
    0 on padding); `is_weight` `[B, T]` (1 where no IS is applied) and `keep` `[B, T]` bool (True
    where no mask is applied), both only meaningful where `response_mask` != 0; `log_ratio` `[B, T]`
    (the clamped per-token log rho, 0 on padding)."""

    token_weight: Tensor
    is_weight: Tensor
    keep: Tensor
    log_ratio: Tensor


def _sequence_level(log_ratio: Tensor, valid: Tensor, mean: bool) -> Tensor:
    """Each row's sum (or mean over its tokens) of `log_ratio`, broadcast back to `[B, T]`."""
    total = log_ratio.sum(-1, keepdim=True)
    if mean:
        total = total / valid.sum(-1, keepdim=True).clamp(min=1).to(total.dtype)
    return total.expand_as(log_ratio)


def rollout_correction_weights(target_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor,
                       settings: RolloutCorrection) -> CorrectionResult:
    """The TIS weights and MIS mask of `settings` for `[B, T]` log-probs (computed without grad).

    `target_log_prob`: the trainer's old policy; `rollout_log_prob`: the rollout engine's (behaviour).
    """
    if target_log_prob.shape != rollout_log_prob.shape or target_log_prob.shape != response_mask.shape:
        raise ValueError(f"target {tuple(target_log_prob.shape)}, rollout {tuple(rollout_log_prob.shape)} and "
                         f"mask {tuple(response_mask.shape)} log-probs must have one [B, T] shape")
    with torch.no_grad():
        valid = response_mask != 0
        dtype = torch.promote_types(target_log_prob.dtype, torch.float32)
        raw = target_log_prob.detach().to(dtype) - rollout_log_prob.detach().to(dtype)
        zero = torch.zeros((), dtype=dtype, device=raw.device)
        log_ratio = torch.where(valid, raw.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND), zero)

        if settings.is_level == "none":
            is_weight = torch.ones_like(log_ratio)
        else:
            level = log_ratio if settings.is_level == "token" else _sequence_level(log_ratio, valid, mean=False)
            # the cap is applied in log space: a long sequence's summed log-ratio cannot overflow exp
            is_weight = torch.exp(level.clamp(max=math.log(settings.is_cap)))

        if settings.mask_level == "none":
            keep = torch.ones_like(valid)
        else:
            level = (log_ratio if settings.mask_level == "token"
                     else _sequence_level(log_ratio, valid, mean=settings.mask_level == "geometric"))
            low = math.log(settings.mask_low) if settings.mask_low > 0 else -math.inf
            keep = (level >= low) & (level <= math.log(settings.mask_high))

        token_weight = torch.where(valid & keep, is_weight, zero)
    return CorrectionResult(token_weight=token_weight, is_weight=is_weight, keep=keep, log_ratio=log_ratio)


def correction_metrics(result: CorrectionResult, response_mask: Tensor, settings: RolloutCorrection,
                       tokens: Tensor | float, seqs: Tensor | float) -> dict[str, Tensor]:
    """Loss-function metric entries (`mean/`, `max/`, `total/` as `hybridrl.training.metrics` sums them).

    `rollout_correction/is_weight_mean` / `_max` (IS on: over the response tokens, after the cap),
    `masked_token_fraction` and `masked_seq_fraction` (mask on: the share of response tokens masked,
    and of sequences with at least one masked token) and `log_ratio_abs_max` (always). The fractions
    are this micro-batch's counts over the mini-batch's `tokens` / `seqs`, so their sums over
    micro-batches and DP ranks are the mini-batch's fractions.
    """
    with torch.no_grad():
        valid = response_mask != 0
        zero = torch.zeros((), dtype=result.log_ratio.dtype, device=result.log_ratio.device)
        any_token = bool(valid.numel())
        out = {"max/rollout_correction/log_ratio_abs_max":
               torch.where(valid, result.log_ratio.abs(), zero).max() if any_token else zero}
        if settings.is_level != "none":
            count = valid.sum().clamp(min=1).to(zero.dtype)
            out["mean/rollout_correction/is_weight_mean"] = torch.where(valid, result.is_weight, zero).sum() / count
            out["max/rollout_correction/is_weight_max"] = (
                torch.where(valid, result.is_weight, zero).max() if any_token else zero)
        if settings.mask_level != "none":
            masked = valid & ~result.keep
            out["total/rollout_correction/masked_token_fraction"] = masked.sum().to(zero.dtype) / _nonzero(tokens)
            out["total/rollout_correction/masked_seq_fraction"] = (
                masked.any(-1).sum().to(zero.dtype) / _nonzero(seqs))
    return out


def _nonzero(count: Tensor | float) -> Tensor | float:
    if isinstance(count, Tensor):
        return count.clamp(min=1)
    return max(count, 1)
