"""GSM8K-style final answers: ``#### 42`` at the end of the solution.

Modes:
* ``strict``: only an answer written after ``####`` counts (the format the data's solutions use);
* ``flexible``: the last number anywhere in the response (for models not trained on the format).

Numbers are compared by value: ``1,000`` = ``1000`` = ``1000.00``, ``-3`` stays negative, a trailing
period or dollar sign is ignored. Score: 1.0 right; ``format_score`` when an answer was found but is
wrong; 0.0 when no answer was found.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from hybridrl.rewards.answers import NUMBER_IN_TEXT, last_number, numbers_equal
from hybridrl.rewards.registry import ScoreResult, register_scorer

GSM8K_MODES = ("strict", "flexible")
_HASH_ANSWER = re.compile(r"####\s*\$?\s*(" + NUMBER_IN_TEXT.pattern + r")")


def extract_hash_answer(text: str) -> str | None:
    """The number after the last ``####`` ("... #### 1,234" -> "1,234"), or None."""
    text = text.replace("\u2212", "-")
    matches = _HASH_ANSWER.findall(text)
    return matches[-1] if matches else None


def extract_gsm8k_answer(text: str, mode: str = "strict") -> str | None:
    if mode == "strict":
        return extract_hash_answer(text)
    if mode == "flexible":
        return last_number(text)
    raise ValueError(f"gsm8k mode must be one of {GSM8K_MODES}, got {mode!r}")


def ground_truth_answer(ground_truth: Any) -> str:
    """The reference number: a bare value, or a full GSM8K solution ending in ``#### N``."""
    text = str(ground_truth)
    return extract_hash_answer(text) or text.strip()


@register_scorer("gsm8k", "openai/gsm8k")
def gsm8k_score(
    response: str,
    ground_truth: Any,
    extra: Mapping[str, Any] | None = None,
    *,
    mode: str = "strict",
    format_score: float = 0.0,
) -> ScoreResult:
    answer = extract_gsm8k_answer(response, mode)
    reference = ground_truth_answer(ground_truth)
    if answer is None:
        return ScoreResult(0.0, False, {"answer": None, "reference": reference})
    correct = numbers_equal(answer, reference)
    return ScoreResult(1.0 if correct else format_score, correct, {"answer": answer, "reference": reference})
