"""Per-token KL penalty estimators between the policy and the reference policy.

With samples drawn from the policy and log_ratio = log_prob - ref_log_prob (Schulman's "Approximating
KL divergence" note):
    k1  (alias kl)          log_ratio                          unbiased, high variance, can be < 0
    k2  (alias mse)         0.5 * log_ratio**2                 biased, low variance, >= 0
    k3  (alias low_var_kl)  exp(-log_ratio) + log_ratio - 1    unbiased, low variance, >= 0
    abs                     |log_ratio|
k3 is clamped to [-10, 10] as peers do; its exponent is also clamped to [-20, 20] first so that an
extreme log-ratio cannot make exp overflow to inf (whose gradient would be NaN). Both clamps leave
values inside the final [-10, 10] range unchanged.
"""
from __future__ import annotations

import torch
from torch import Tensor

from hybridrl.algorithms.names import (
    KL_PENALTY_ALIASES,
    KL_PENALTY_KINDS,
    KL_PENALTY_NAMES,
    unknown_name_message,
)

K3_BOUND = 10.0
EXP_LOG_RATIO_BOUND = 20.0


def canonical_kl_kind(kind: str) -> str:
    """`k1`/`k2`/`k3`/`abs` for a kind or alias; ValueError naming the valid kinds otherwise."""
    kind = KL_PENALTY_ALIASES.get(kind, kind)
    if kind not in KL_PENALTY_KINDS:
        raise ValueError(unknown_name_message("KL penalty kind", kind, KL_PENALTY_NAMES))
    return kind


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kind: str = "k1") -> Tensor:
    """Per-token KL estimate `[B, T]` (same shape as the inputs; no masking, no reduction)."""
    kind = canonical_kl_kind(kind)
    log_ratio = log_prob - ref_log_prob
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "abs":
        return log_ratio.abs()
    # k3: with r = ref/policy = exp(-log_ratio), KL ~ r - log r - 1.
    neg_log_ratio = torch.clamp(-log_ratio, -EXP_LOG_RATIO_BOUND, EXP_LOG_RATIO_BOUND)
    k3 = torch.exp(neg_log_ratio) - neg_log_ratio - 1
    return torch.clamp(k3, -K3_BOUND, K3_BOUND)
