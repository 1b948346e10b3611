"""Config problems: each names the dotted field, its value, the rule, and what would be valid."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ConfigIssue:
    field: str
    value: Any
    rule: str
    valid: Sequence[Any] = field(default_factory=tuple)

    def __str__(self) -> str:
        text = f"{self.field}={show_value(self.value)} {self.rule}"
        if self.valid:
            text += f"; valid: {', '.join(show_value(v) for v in self.valid)}"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"field": self.field, "value": self.value, "rule": self.rule, "valid": list(self.valid)}


class ConfigError(ValueError):
    """All problems found in a config, reported together."""

    def __init__(self, issues: Sequence[ConfigIssue]):
        self.issues = list(issues)
        lines = "\n".join(f"  - {issue}" for issue in self.issues)
        super().__init__(f"{len(self.issues)} config error(s):\n{lines}")


def show_value(value: Any) -> str:
    """A value as config messages print it (strings bare unless empty or spaced, floats short)."""
    if isinstance(value, str):
        return value if value and " " not in value else repr(value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
