"""Advantage estimators: GAE (critic), and the critic-free GRPO / Dr.GRPO, RLOO, REINFORCE++, ReMax.

Shapes: token tensors are `[B, T]` (B sequences, T response positions) with a `response_mask` of
the same shape (bool or float, nonzero = a response token). Outcome-based estimators take one
score per sequence, `[B]`, and return one advantage per sequence, `[B]`;
`sequence_to_token_advantages` spreads those over the response tokens.

Masked positions: rewards and values there are ignored, and outputs there are exactly 0. The
backward recursions (GAE, discounted returns) *skip* masked positions instead of resetting at
them: "the next token" of a response token is the next unmasked position in its row, so a hole in
the mask (e.g. a tool-output span inside a multi-turn response) does not cut the credit chain,
and nothing flows from padding into the response.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from hybridrl.algorithms.masking import masked_fill_zero, masked_whiten

GroupIndex = Tensor | Sequence[Any]


def gae_advantages(
    token_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016), raw (not whitened).

    For each unmasked position t, with t' the next unmasked position in the row (none after the
    last one, where the value and advantage to come are 0):
        delta_t = r_t + gamma * V_t' - V_t
        A_t     = delta_t + gamma * lam * A_t'
        R_t     = A_t + V_t
    Masked positions get A = R = 0 and their rewards/values are not read.

    Args: `token_rewards`, `values`, `response_mask` are `[B, T]`.
    Returns: `(advantages, returns)`, both `[B, T]`, in the promoted dtype of rewards and values.
    """
    _check_same_shape(token_rewards=token_rewards, values=values, response_mask=response_mask)
    dtype = torch.promote_types(token_rewards.dtype, values.dtype)
    rewards, values = token_rewards.to(dtype), values.to(dtype)
    valid = response_mask != 0
    batch, length = rewards.shape
    next_value = torch.zeros(batch, dtype=dtype, device=rewards.device)
    next_advantage = torch.zeros_like(next_value)
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    columns = []
    for t in reversed(range(length)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        # A masked position passes the state from later tokens straight through to earlier ones.
        next_advantage = torch.where(valid[:, t], advantage, next_advantage)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        columns.append(torch.where(valid[:, t], advantage, zero))
    advantages = torch.stack(columns[::-1], dim=1)
    returns = torch.where(valid, advantages + values, zero)
    return advantages, returns


def discounted_returns(token_rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """Returns-to-go G_t = r_t + gamma * G_t' over unmasked positions (t' = next unmasked), `[B, T]`.

    Masked positions get 0 and their rewards are ignored (same skipping rule as `gae_advantages`).
    """
    _check_same_shape(token_rewards=token_rewards, response_mask=response_mask)
    valid = response_mask != 0
    running = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype, device=token_rewards.device)
    zero = torch.zeros((), dtype=token_rewards.dtype, device=token_rewards.device)
    columns = []
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(valid[:, t], token_rewards[:, t] + gamma * running, running)
        columns.append(torch.where(valid[:, t], running, zero))
    return torch.stack(columns[::-1], dim=1)


def reinforce_pp_advantages(token_rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """REINFORCE++ (Hu 2025): discounted returns-to-go, whitened over all response tokens of the batch.

    Returns `[B, T]`, 0 at masked positions.
    """
    returns = discounted_returns(token_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask)


def grpo_advantages(
    scores: Tensor, group_index: GroupIndex, norm_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Group-relative advantages (GRPO, Shao et al. 2024): (score - group mean) / (group std + eps).

    Args:
        scores: `[B]`, one outcome score per sequence.
        group_index: `B` group keys (a 1-D tensor, or a list/array of ints, strings or uids);
            sequences with equal keys form a group; groups may be interleaved in any order.
        norm_by_std: divide by the unbiased group std; False gives Dr.GRPO (Liu et al. 2025),
            which only subtracts the group mean.
    Returns: `[B]` advantages in the dtype of `scores`. A group of one gets 0 (it has no peers to
    compare against); a group of equal scores gets 0.
    """
    group_ids, num_groups = group_ids_from_index(group_index, scores)
    counts, sums = _group_counts_and_sums(scores, group_ids, num_groups)
    deviation = scores - (sums / counts)[group_ids]
    if not norm_by_std:
        return deviation
    squared = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    squared.index_add_(0, group_ids, deviation**2)
    # Bessel's correction; a group of one has deviation 0, so any positive divisor gives std 0.
    std = torch.sqrt(squared / torch.clamp(counts - 1, min=1))
    # A group of one must stay 0 even with eps = 0 (0 / 0).
    return torch.where(counts[group_ids] > 1, deviation / (std[group_ids] + eps), torch.zeros_like(deviation))


def rloo_advantages(scores: Tensor, group_index: GroupIndex) -> Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): score minus the mean score of the *other*
    members of its group. `scores` `[B]`, `group_index` as in `grpo_advantages`; returns `[B]`.
    A group of one has no baseline and gets 0.
    """
    group_ids, num_groups = group_ids_from_index(group_index, scores)
    counts, sums = _group_counts_and_sums(scores, group_ids, num_groups)
    count, total = counts[group_ids], sums[group_ids]
    baseline = (total - scores) / torch.clamp(count - 1, min=1)
    return torch.where(count > 1, scores - baseline, torch.zeros_like(scores))


def remax_advantages(scores: Tensor, baseline_scores: Tensor) -> Tensor:
    """ReMax (Li et al. 2023): score minus the score of the greedy response to the same prompt.

    Both `[B]`; returns `[B]`.
    """
    if scores.shape != baseline_scores.shape or scores.dim() != 1:
        raise ValueError(
            f"scores {tuple(scores.shape)} and baseline_scores {tuple(baseline_scores.shape)} "
            "must both be [B]"
        )
    return scores - baseline_scores.to(scores.dtype)


def sequence_to_token_advantages(advantages: Tensor, response_mask: Tensor) -> Tensor:
    """Spread per-sequence advantages `[B]` over the response tokens: `[B, T]`, 0 where masked."""
    if advantages.dim() != 1 or advantages.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} must be [B] for a response_mask "
            f"{tuple(response_mask.shape)}"
        )
    return masked_fill_zero(advantages[:, None].expand(response_mask.shape), response_mask != 0)


def sequence_scores(token_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """Outcome score per sequence `[B]`: the sum of its token rewards over the response."""
    _check_same_shape(token_rewards=token_rewards, response_mask=response_mask)
    return masked_fill_zero(token_rewards, response_mask != 0).sum(-1)


def group_ids_from_index(group_index: GroupIndex, scores: Tensor) -> tuple[Tensor, int]:
    """Dense group ids `[B]` (int64, on the device of `scores`) and the number of groups.

    Keys may be any hashable values (ints, strings, uuids) or a 1-D tensor; their order is free.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be [B] (one per sequence), got shape {tuple(scores.shape)}")
    if isinstance(group_index, Tensor):
        if group_index.dim() != 1:
            raise ValueError(f"group_index must be 1-D, got shape {tuple(group_index.shape)}")
        keys, ids = torch.unique(group_index, return_inverse=True)
        ids, num_groups = ids.to(device=scores.device, dtype=torch.long), keys.numel()
    else:
        dense: dict[Any, int] = {}
        ids = torch.tensor(
            [dense.setdefault(_hashable(key), len(dense)) for key in group_index],
            dtype=torch.long, device=scores.device,
        )
        num_groups = len(dense)
    if ids.shape[0] != scores.shape[0]:
        raise ValueError(f"group_index has {ids.shape[0]} entries for {scores.shape[0]} scores")
    return ids, num_groups


def _hashable(key: Any) -> Any:
    # A list of 0-dim tensors would hash by identity (every key its own group): use plain values.
    if hasattr(key, "item") and callable(key.item):
        return key.item()
    return key


def _group_counts_and_sums(scores: Tensor, group_ids: Tensor, num_groups: int) -> tuple[Tensor, Tensor]:
    counts = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    counts.index_add_(0, group_ids, torch.ones_like(scores))
    sums = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    sums.index_add_(0, group_ids, scores)
    return counts, sums


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    distinct = set(shapes.values())
    if len(distinct) != 1 or len(distinct.pop()) != 2:
        raise ValueError(f"expected [B, T] tensors of one shape, got {shapes}")
