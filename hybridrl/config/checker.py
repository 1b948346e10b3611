"""The checker every plan-time rule reports to, and the arithmetic its messages use to name the nearest
valid values (divisors, nearest multiples). Torch-free."""
from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hybridrl.config.errors import ConfigIssue


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else []


def nearest(value: Any, candidates: Iterable[int], k: int = 4) -> list[int]:
    """Up to k candidates closest to value, in increasing order."""
    pool = sorted(set(candidates))
    if not isinstance(value, (int, float)):
        return pool[:k]
    return sorted(sorted(pool, key=lambda c: (abs(c - value), c))[:k])


def nearest_satisfying(value: int, ok: Callable[[int], bool], k: int = 4, limit: int = 1 << 16) -> list[int]:
    """Up to k positive integers closest to value for which ok() holds (searching outwards)."""
    found: list[int] = []
    base = value if isinstance(value, int) and value > 0 else 1
    for step in range(limit):
        for candidate in {base - step, base + step}:
            if candidate > 0 and candidate not in found and ok(candidate):
                found.append(candidate)
        if len(found) >= k:
            break
    return sorted(found[:k])


def nearest_multiples(value: int, step: int, k: int = 4) -> list[int]:
    """`nearest_satisfying(value, lambda v: v % step == 0, k)` by arithmetic: a search over a 1,024-GPU job's layouts
    meets steps of hundreds, which the outward scan walks one by one."""
    base = value if isinstance(value, int) and value > 0 else 1
    below = [m for m in range(base // step * step, 0, -step)][:k]
    above = [base // step * step + step * i for i in range(1, k + 1)]
    return sorted(sorted(set(below + above), key=lambda m: (abs(m - base), m))[:k])


class Checker:
    """Collects issues; helpers return whether the rule held so dependent rules can be skipped."""

    def __init__(self, issues: list[ConfigIssue], warnings: list[str]):
        self.issues = issues
        self.warnings = warnings

    def fail(self, field: str, value: Any, rule: str, valid: Sequence[Any] = ()) -> bool:
        self.issues.append(ConfigIssue(field, value, rule, tuple(valid)))
        return False

    def is_int_at_least(self, field: str, value: Any, low: int) -> bool:
        if isinstance(value, int) and not isinstance(value, bool) and value >= low:
            return True
        return self.fail(field, value, f"must be an integer >= {low}")

    def in_range(self, field: str, value: Any, low: float, high: float, *, low_open: bool = False,
                 high_open: bool = False) -> bool:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return self.fail(field, value, "must be a number")
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        if above and below:
            return True
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        return self.fail(field, value, f"must be in {left}{low:g}, {high:g}{right}")

    def one_of(self, field: str, value: Any, valid: Sequence[str], what: str = "value") -> bool:
        if value in valid:
            return True
        close = difflib.get_close_matches(str(value), list(valid), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return self.fail(field, value, f"is not a known {what}{hint}", valid)
