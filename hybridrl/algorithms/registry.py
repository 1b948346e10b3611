"""Advantage-estimator registry: `algorithm.adv_estimator` names -> functions of one signature.

Every estimator takes an `AdvantageInputs` and returns `(advantages, returns)`, both `[B, T]` and
0 at masked positions. Outcome estimators (grpo, dr_grpo, rloo, remax) score a sequence by the sum
of its token rewards over the response mask, and their "returns" are the advantages (there is no
critic to regress). `gae` returns whitened advantages (standard PPO) unless
`whiten_advantages=False`, and raw returns for the critic.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from hybridrl.algorithms import advantages as adv
from hybridrl.algorithms.masking import masked_whiten
from hybridrl.algorithms.names import unknown_name_message


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read. `token_rewards` and `response_mask` are `[B, T]`;
    `values` `[B, T]` (gae); `group_index` `B` keys (grpo, dr_grpo, rloo);
    `baseline_scores` `[B]` (remax: the scores of the greedy responses)."""

    token_rewards: Tensor
    response_mask: Tensor
    values: Tensor | None = None
    group_index: Any = None
    baseline_scores: Tensor | None = None
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True
    eps: float = 1e-6
    whiten_advantages: bool = True


AdvantageEstimator = Callable[[AdvantageInputs], tuple[Tensor, Tensor]]
ADV_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_adv_estimator(
    name: str, *, override: bool = False
) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator adding an estimator under `name`; re-registering a name needs `override=True`.

    Names registered here beyond `names.ADV_ESTIMATOR_NAMES` resolve at run time but are unknown
    to the (torch-free) config validator; add built-ins to both.
    """
    def decorate(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in ADV_ESTIMATORS and not override:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADV_ESTIMATORS[name] = fn
        return fn

    return decorate


def get_adv_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as `name`; ValueError with the valid names and a guess otherwise."""
    try:
        return ADV_ESTIMATORS[name]
    except (KeyError, TypeError):
        raise ValueError(unknown_name_message("advantage estimator", name, ADV_ESTIMATORS)) from None


def compute_advantages(
    name: str, token_rewards: Tensor, response_mask: Tensor, **inputs: Any
) -> tuple[Tensor, Tensor]:
    """`get_adv_estimator(name)(AdvantageInputs(token_rewards, response_mask, **inputs))`."""
    return get_adv_estimator(name)(AdvantageInputs(token_rewards, response_mask, **inputs))


def _require(inputs: AdvantageInputs, field: str, estimator: str) -> Any:
    value = getattr(inputs, field)
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} needs {field}")
    return value


def _outcome(inputs: AdvantageInputs, sequence_advantages: Tensor) -> tuple[Tensor, Tensor]:
    token_advantages = adv.sequence_to_token_advantages(sequence_advantages, inputs.response_mask)
    return token_advantages, token_advantages


@register_adv_estimator("gae")
def _gae(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    values = _require(inputs, "values", "gae")
    advantages, returns = adv.gae_advantages(
        inputs.token_rewards, values, inputs.response_mask, inputs.gamma, inputs.lam
    )
    if inputs.whiten_advantages:
        advantages = masked_whiten(advantages, inputs.response_mask)
    return advantages, returns


@register_adv_estimator("grpo")
def _grpo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    scores = adv.sequence_scores(inputs.token_rewards, inputs.response_mask)
    group_index = _require(inputs, "group_index", "grpo")
    return _outcome(inputs, adv.grpo_advantages(scores, group_index, inputs.norm_by_std, inputs.eps))


@register_adv_estimator("dr_grpo")
def _dr_grpo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    scores = adv.sequence_scores(inputs.token_rewards, inputs.response_mask)
    group_index = _require(inputs, "group_index", "dr_grpo")
    return _outcome(inputs, adv.grpo_advantages(scores, group_index, norm_by_std=False))


@register_adv_estimator("rloo")
def _rloo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    scores = adv.sequence_scores(inputs.token_rewards, inputs.response_mask)
    return _outcome(inputs, adv.rloo_advantages(scores, _require(inputs, "group_index", "rloo")))


@register_adv_estimator("reinforce_plus_plus")
def _reinforce_plus_plus(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    returns = adv.discounted_returns(inputs.token_rewards, inputs.response_mask, inputs.gamma)
    return masked_whiten(returns, inputs.response_mask), returns


@register_adv_estimator("remax")
def _remax(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    scores = adv.sequence_scores(inputs.token_rewards, inputs.response_mask)
    baseline = _require(inputs, "baseline_scores", "remax")
    return _outcome(inputs, adv.remax_advantages(scores, baseline))
