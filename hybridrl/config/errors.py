"""Config problems: each names the dotted field, its value, the rule, and what would be valid."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

CONFIG_FILE = "<config file>"  # the field of a problem with the YAML file itself


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

    def __init__(self, issues: Sequence[ConfigIssue], hint: str | None = None):
        self.issues = list(issues)
        self.hint = hint  # one line after the list: what to do when the errors have a common way out
        lines = "\n".join(f"  - {issue}" for issue in self.issues)
        super().__init__(f"{len(self.issues)} config error(s):\n{lines}" + (f"\n{hint}" if hint else ""))

    def to_dict(self) -> dict[str, Any]:
        return {"valid": False, "errors": [issue.to_dict() for issue in self.issues],
                **({"hint": self.hint} if self.hint else {})}


def show_value(value: Any) -> str:
    """A value as config messages print it (strings bare unless empty or spaced, floats short)."""
    if isinstance(value, str):
        return value if value and " " not in value else repr(value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
