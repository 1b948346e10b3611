"""RL algorithms core: advantages, policy/value losses, KL, loss aggregation, KL controllers,
rollout-mismatch correction (TIS / MIS weights).

Pure torch functions (plus the KL controllers' coefficient). The public names below are loaded
lazily (PEP 562 `__getattr__`, from the `_EXPORTS` table) because importing any submodule runs this
`__init__` first: `import hybridrl.algorithms.names` -- which the torch-free config package does, so
`hybridrl plan` too -- must not import torch through eager re-exports here. The `TYPE_CHECKING`
block repeats the table for static analysers only (tests/algorithms/test_names.py keeps the two equal).

Conventions (details in each module): token tensors are `[B, T]` with a `response_mask` (bool or
float weights) of the same shape; per-sequence tensors are `[B]`; masked positions are never read
and come out as 0.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    # names (torch-free)
    "ADV_ESTIMATOR_NAMES": "names",
    "CRITIC_ADV_ESTIMATORS": "names",
    "GROUP_ADV_ESTIMATORS": "names",
    "GREEDY_BASELINE_ADV_ESTIMATORS": "names",
    "LOSS_AGG_MODES": "names",
    "KL_PENALTY_KINDS": "names",
    "KL_PENALTY_ALIASES": "names",
    "KL_PENALTY_NAMES": "names",
    "KL_CONTROLLER_KINDS": "names",
    "ROLLOUT_IS_LEVELS": "names",
    "ROLLOUT_MASK_LEVELS": "names",
    # masked reductions
    "masked_mean": "masking",
    "masked_sum": "masking",
    "masked_var": "masking",
    "masked_whiten": "masking",
    # advantages
    "gae_advantages": "advantages",
    "grpo_advantages": "advantages",
    "rloo_advantages": "advantages",
    "reinforce_pp_advantages": "advantages",
    "remax_advantages": "advantages",
    "discounted_returns": "advantages",
    "sequence_scores": "advantages",
    "sequence_to_token_advantages": "advantages",
    # registry
    "ADV_ESTIMATORS": "registry",
    "AdvantageInputs": "registry",
    "compute_advantages": "registry",
    "get_adv_estimator": "registry",
    "register_adv_estimator": "registry",
    # KL
    "kl_penalty": "kl",
    "canonical_kl_kind": "kl",
    "FixedKLController": "kl_control",
    "AdaptiveKLController": "kl_control",
    "make_kl_controller": "kl_control",
    "kl_controller_from_config": "kl_control",
    # losses and aggregation
    "ppo_policy_loss": "losses",
    "value_loss": "losses",
    "aggregate_loss": "aggregation",
    "LossNormalizers": "aggregation",
    "count_loss_normalizers": "aggregation",
    "global_loss_normalizers": "aggregation",
    # rollout-mismatch correction
    "RolloutCorrection": "rollout_correction",
    "rollout_correction_weights": "rollout_correction",
    "correction_metrics": "rollout_correction",
    "Truncation": "truncation",
    "truncated_log_prob": "truncation",
    # logits
    "entropy_from_logits": "logits",
    "log_prob_from_logits": "logits",
    "vocab_parallel_entropy": "vocab_parallel",
    "vocab_parallel_log_prob": "vocab_parallel",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module_name}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # static analysers and IDEs see the eager imports
    from hybridrl.algorithms.advantages import (  # noqa: F401
        discounted_returns,
        gae_advantages,
        grpo_advantages,
        reinforce_pp_advantages,
        remax_advantages,
        rloo_advantages,
        sequence_scores,
        sequence_to_token_advantages,
    )
    from hybridrl.algorithms.aggregation import (  # noqa: F401
        LossNormalizers,
        aggregate_loss,
        count_loss_normalizers,
        global_loss_normalizers,
    )
    from hybridrl.algorithms.kl import canonical_kl_kind, kl_penalty  # noqa: F401
    from hybridrl.algorithms.kl_control import (  # noqa: F401
        AdaptiveKLController,
        FixedKLController,
        kl_controller_from_config,
        make_kl_controller,
    )
    from hybridrl.algorithms.logits import entropy_from_logits, log_prob_from_logits  # noqa: F401
    from hybridrl.algorithms.losses import ppo_policy_loss, value_loss  # noqa: F401
    from hybridrl.algorithms.masking import masked_mean, masked_sum, masked_var, masked_whiten  # noqa: F401
    from hybridrl.algorithms.names import (  # noqa: F401
        ADV_ESTIMATOR_NAMES,
        CRITIC_ADV_ESTIMATORS,
        GREEDY_BASELINE_ADV_ESTIMATORS,
        GROUP_ADV_ESTIMATORS,
        KL_CONTROLLER_KINDS,
        KL_PENALTY_ALIASES,
        KL_PENALTY_KINDS,
        KL_PENALTY_NAMES,
        LOSS_AGG_MODES,
        ROLLOUT_IS_LEVELS,
        ROLLOUT_MASK_LEVELS,
    )
    from hybridrl.algorithms.registry import (  # noqa: F401
        ADV_ESTIMATORS,
        AdvantageInputs,
        compute_advantages,
        get_adv_estimator,
        register_adv_estimator,
    )
    from hybridrl.algorithms.rollout_correction import (  # noqa: F401
        RolloutCorrection,
        correction_metrics,
        rollout_correction_weights,
    )
    from hybridrl.algorithms.truncation import Truncation, truncated_log_prob  # noqa: F401
    from hybridrl.algorithms.vocab_parallel import vocab_parallel_entropy, vocab_parallel_log_prob  # noqa: F401
