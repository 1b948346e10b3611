"""Format check: the response is a sequence of tagged blocks, e.g. ``<think>...</think><answer>...</answer>``.

Each tag must appear exactly once, in the given order, with only whitespace between and around the
blocks. The tags are configurable (``get_scorer("format", tags=("reasoning", "answer"))``).
Score 1.0 when the format is met, else 0.0; ``acc`` mirrors it (the format is the whole task here).
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from hybridrl.rewards.registry import ScoreResult, register_scorer

DEFAULT_TAGS = ("think", "answer")


def format_pattern(tags: Sequence[str]) -> re.Pattern[str]:
    if not tags:
        raise ValueError("the format check needs at least one tag")
    for tag in tags:
        if not re.fullmatch(r"[A-Za-z_][\w\-]*", tag):
            raise ValueError(f"invalid tag name {tag!r}: use letters, digits, '_' or '-'")
    blocks = r"\s*".join(rf"<{re.escape(tag)}>(?P<{_group(tag)}>.*?)</{re.escape(tag)}>" for tag in tags)
    return re.compile(rf"^\s*{blocks}\s*$", re.DOTALL)


def _group(tag: str) -> str:
    return "block_" + tag.replace("-", "_")


def tag_counts_ok(response: str, tags: Sequence[str]) -> bool:
    # The lazy pattern alone would accept "<think>a</think><think>b</think>" inside one block.
    return all(response.count(f"<{tag}>") == 1 and response.count(f"</{tag}>") == 1 for tag in tags)


def extract_tag(response: str, tag: str) -> str | None:
    """The content of the last ``<tag>...</tag>`` block, stripped, or None."""
    matches = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", response, re.DOTALL)
    return matches[-1].strip() if matches else None


@register_scorer("format", "think_answer_format")
def format_score(
    response: str,
    ground_truth: Any = None,
    extra: Mapping[str, Any] | None = None,
    *,
    tags: Sequence[str] = DEFAULT_TAGS,
) -> ScoreResult:
    match = format_pattern(tags).match(response)
    ok = match is not None and tag_counts_ok(response, tags)
    return ScoreResult(1.0 if ok else 0.0, ok, {"tags": tuple(tags)})
