"""Per-turn rewards of multi-turn rollouts (`actor_rollout_ref.rollout.multi_turn.turn_reward`).

A trajectory's reward (the scorer's or the reward model's) judges the final answer and lands on the
last token the model wrote. A per-turn reward judges one model turn and lands on that turn's last
token: `TurnRewarder` gives each model turn

    - tool_error_penalty * (the turn's tool calls that failed: any status but ok)
    + function(turn)                      (a user function from a trusted file, when set)

The agent loop calls it once per model turn after the conversation ended (`ModelTurn` holds what the
turn wrote and what its calls answered). At inference TP > 1 every TP rank of a replica runs the loop
and only TP rank 0's batch is kept, so a user function should be a pure function of the turn (no side
effects that must happen once). The rollout batch carries the values as `turn_scores`
[B, R], zero except on each model turn's last response position. The trainer adds them to
`token_level_scores` (`hybridrl.trainer.rl_step.add_turn_scores`), so they compose with every estimator
the way any token-level reward does: the outcome estimators (grpo, dr_grpo, rloo, remax) see a
sequence's total, final score + every turn reward; gae and reinforce_plus_plus credit a turn reward to
that turn's tokens and those before it (returns-to-go over model tokens, observation positions skipped).
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridrl.tool_calling import Observation
from hybridrl.user_code import import_user_file


class TurnRewardError(RuntimeError):
    """A per-turn reward function that cannot be loaded, raises, or returns something that is not a finite
    number; the message names the function and the turn."""


@dataclass(frozen=True)
class ModelTurn:
    """One model turn as a per-turn reward function sees it."""

    index: int  # 0 for the conversation's first model turn
    text: str  # what the model wrote in this turn (special tokens removed)
    token_ids: tuple[int, ...]
    observations: tuple[Observation, ...]  # the answers its tool calls got (none: no call, or calls not run)
    final: bool  # no model turn follows (the conversation ended after this one)
    finish_reason: str  # the conversation's: "stop", "max_turns" or "length" ("" while it goes on)
    sample: Mapping[str, Any]  # the sample's data row (ground truth, extra info, ...; empty when not given)


TurnRewardFunction = Callable[[ModelTurn], Any]


class TurnRewarder:
    """The reward of each model turn; see the module docstring."""

    def __init__(self, tool_error_penalty: float = 0.0, function: TurnRewardFunction | None = None,
                 name: str = "turn reward function") -> None:
        if not math.isfinite(tool_error_penalty) or tool_error_penalty < 0:
            raise ValueError(f"tool_error_penalty={tool_error_penalty} must be a finite number >= 0")
        self.tool_error_penalty = float(tool_error_penalty)
        self.function = function
        self.name = name

    def __call__(self, turn: ModelTurn) -> float:
        reward = -self.tool_error_penalty * sum(not o.ok for o in turn.observations)
        if self.function is None:
            return reward
        where = f"model turn {turn.index} of sample {dict(turn.sample).get('uid', '?')}"
        try:
            value = self.function(turn)
        except Exception as error:
            raise TurnRewardError(f"{self.name} raised {type(error).__name__}: {error} on {where}") from error
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise TurnRewardError(f"{self.name} returned {value!r} on {where}; it must return a finite number")
        return reward + float(value)


def load_turn_reward_function(path: str | Path, name: str) -> TurnRewardFunction:
    """The function `name` of the file `path` (trusted code: it is executed)."""
    module = import_user_file(Path(path), what="turn reward file", prefix="hybridrl_turn_reward_",
                              error=TurnRewardError)
    function = getattr(module, name, None)
    if function is None or not callable(function):
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise TurnRewardError(f"turn reward file {str(path)!r} defines no function {name!r}; functions there: "
                              f"{defined}")
    return function


def turn_rewarder_from_config(turn_reward: Any) -> TurnRewarder | None:
    """The rewarder a `multi_turn.turn_reward` section asks for; None when it asks for nothing."""
    function = None
    if turn_reward.path:
        function = load_turn_reward_function(turn_reward.path, turn_reward.name)
    if function is None and not turn_reward.tool_error_penalty:
        return None
    return TurnRewarder(turn_reward.tool_error_penalty, function,
                        f"turn reward function {turn_reward.name!r} from {turn_reward.path}" if function else "")


def turn_scores_row(turn_ends: Sequence[int], rewards: Sequence[float], width: int) -> list[float]:
    """One response row of `turn_scores`: `rewards[k]` at position `turn_ends[k]` (turn k's last token)."""
    if len(turn_ends) != len(rewards):
        raise ValueError(f"{len(turn_ends)} turn ends for {len(rewards)} turn rewards")
    row = [0.0] * width
    for end, reward in zip(turn_ends, rewards):
        if not 0 <= end < width:
            raise ValueError(f"a model turn ends at response position {end}, outside a {width}-token response")
        row[end] += reward
    return row
