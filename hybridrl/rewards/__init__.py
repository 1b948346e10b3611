"""Rule-based rewards: a registry of scorers, user reward files, and the batch-level `RewardManager`.

    from hybridrl.rewards import RewardManager, get_scorer
    manager = RewardManager.from_config(config.algorithm)          # reward_fn or custom_reward_function
    token_level_rewards, output = manager.score_batch(batch, tokenizer)

Built-in scorers (see `available_scorers()`): gsm8k, math, format, countdown, repeat_letter, arith_word.
"""
from hybridrl.rewards.custom import RewardFunctionError, load_reward_function
from hybridrl.rewards.manager import RewardManager, RewardOutput, reward_metrics, token_level_rewards
from hybridrl.rewards.registry import (
    ScoreResult,
    UnknownScorerError,
    available_scorers,
    get_scorer,
    register_scorer,
)

__all__ = [
    "RewardFunctionError",
    "RewardManager",
    "RewardOutput",
    "ScoreResult",
    "UnknownScorerError",
    "available_scorers",
    "get_scorer",
    "load_reward_function",
    "register_scorer",
    "reward_metrics",
    "token_level_rewards",
]
