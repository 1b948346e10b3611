"""Token log-probabilities and entropies from full-vocabulary logits `[..., V]`.

Math is done in float32 (or float64 for float64 input) whatever the logits' dtype: log-softmax of
bf16 logits over a 150k vocabulary loses the small probabilities RL ratios depend on.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def log_prob_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[label] for `logits` `[..., V]` and integer `labels` `[...]`; float32 `[...]`.

    Computed as logit[label] - logsumexp(logits), which never materializes a second `[..., V]`
    tensor of log-probabilities.
    """
    x = logits.to(_compute_dtype(logits))
    picked = torch.gather(x, -1, labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(x, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(x) - sum_v p_v x_v; float32 `[...]`.

    Stable for any finite logits (both terms are computed relative to the row max). Logits of -inf (a
    banned token) are raised to the float minimum first, so they contribute p = 0 and 0 * x = 0
    instead of 0 * inf = NaN.
    """
    x = logits.to(_compute_dtype(logits))
    x = torch.clamp(x, min=torch.finfo(x.dtype).min)
    # Relative to the row max, log Z and E_p[x] stay O(log V): no cancellation of large terms.
    shifted = x - x.max(dim=-1, keepdim=True).values.detach()
    probs = torch.softmax(shifted, dim=-1)
    return torch.logsumexp(shifted, dim=-1) - (probs * shifted).sum(-1)
