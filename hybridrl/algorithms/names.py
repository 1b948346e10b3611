"""Plain names the algorithms accept, importable without torch.

`hybridrl.config` validates `algorithm.adv_estimator`, `loss_agg_mode`, KL kinds etc. against these
tuples; it must stay torch-free so that `hybridrl plan` and config errors come back instantly. The
torch modules of this package check themselves against the same tuples (and a test checks that
the advantage-estimator registry agrees with `ADV_ESTIMATOR_NAMES`).
"""
from __future__ import annotations

import difflib
from collections.abc import Iterable

ADV_ESTIMATOR_NAMES: tuple[str, ...] = (
    "gae",
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_plus_plus",
    "remax",
)

# What an estimator needs beyond rewards: a critic's values; several samples of one prompt
# (`group_index`, so rollout.n >= 2); the score of a greedy response to the prompt (`baseline_scores`).
CRITIC_ADV_ESTIMATORS: tuple[str, ...] = ("gae",)
GROUP_ADV_ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo")
GREEDY_BASELINE_ADV_ESTIMATORS: tuple[str, ...] = ("remax",)

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

KL_PENALTY_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "abs")
# Names peers use for the same estimators; accepted everywhere a KL kind is.
KL_PENALTY_ALIASES: dict[str, str] = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
KL_PENALTY_NAMES: tuple[str, ...] = KL_PENALTY_KINDS + tuple(KL_PENALTY_ALIASES)

KL_CONTROLLER_KINDS: tuple[str, ...] = ("fixed", "adaptive")

# Rollout-mismatch correction (`hybridrl.algorithms.rollout_correction`): at which level the
# truncated importance weight is taken, and at which level tokens leaving the band are masked
# (geometric: a sequence's mean per-token log-ratio, i.e. the geometric mean of its ratios).
ROLLOUT_IS_LEVELS: tuple[str, ...] = ("none", "token", "sequence")
ROLLOUT_MASK_LEVELS: tuple[str, ...] = ("none", "token", "sequence", "geometric")


def unknown_name_message(what: str, name: object, valid: Iterable[str]) -> str:
    """The error text for an unknown `name`: the valid choices and, when one is close, a guess.

    >>> unknown_name_message("advantage estimator", "grop", ("gae", "grpo"))
    "unknown advantage estimator 'grop'; did you mean 'grpo'? valid: gae, grpo"
    """
    valid = tuple(valid)
    close = difflib.get_close_matches(str(name), valid, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ";"
    return f"unknown {what} {name!r}{hint} valid: {', '.join(valid)}"
