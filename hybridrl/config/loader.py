"""YAML + dotted command-line overrides -> a type-checked `JobConfig`.

All problems are collected before anything is raised, so a user fixes a config in one pass:
unknown keys (with a did-you-mean), wrong types, malformed overrides.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from hybridrl.config.errors import ConfigError, ConfigIssue
from hybridrl.config.schema import JobConfig, MegatronConfig

# Fields users of other trainers write directly on a role: accepted there and moved into the
# role's `megatron` section, so `actor_rollout_ref.actor.tensor_model_parallel_size=2` works too.
_MEGATRON_FIELDS = frozenset(f.name for f in dataclasses.fields(MegatronConfig))


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> JobConfig:
    """Read a YAML job config (or start from defaults) and apply `a.b.c=value` overrides."""
    config, issues = load_config_collecting(path, overrides)
    if issues:
        raise ConfigError(issues)
    return config


def load_config_collecting(
    path: str | Path | None = None, overrides: Iterable[str] = ()
) -> tuple[JobConfig, list[ConfigIssue]]:
    """Like `load_config`, but return the problems instead of raising.

    Unknown keys and ill-typed values are reported and left at their defaults, so the caller can
    go on validating the rest and report everything in one pass.
    """
    issues: list[ConfigIssue] = []
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path), issues)
    for override in overrides:
        _apply_override(raw, override, issues)
    return _build(JobConfig, raw, "", issues), issues


def config_from_dict(raw: Mapping[str, Any]) -> JobConfig:
    """Build a `JobConfig` from a plain nested dict (e.g. `config_to_dict` output)."""
    issues: list[ConfigIssue] = []
    config = _build(JobConfig, dict(raw), "", issues)
    if issues:
        raise ConfigError(issues)
    return config


def config_to_dict(config: Any) -> dict[str, Any]:
    """A plain nested dict (YAML/JSON-ready) of any config dataclass."""
    return dataclasses.asdict(config)


def _read_yaml(path: Path, issues: list[ConfigIssue]) -> dict[str, Any]:
    if not path.is_file():
        issues.append(ConfigIssue("<config file>", str(path), "file not found"))
        return {}
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        issues.append(ConfigIssue("<config file>", str(path), f"not valid YAML: {exc}"))
        return {}
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        issues.append(ConfigIssue("<config file>", str(path), "top level must be a mapping of sections"))
        return {}
    return loaded


def _apply_override(raw: dict[str, Any], override: str, issues: list[ConfigIssue]) -> None:
    key, sep, text = override.partition("=")
    key = key.strip().lstrip("+")
    if not sep or not key or any(not part for part in key.split(".")):
        issues.append(ConfigIssue("<override>", override, "expected the form section.field=value"))
        return
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text  # not YAML: take it as a plain string, the type check decides
    node = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            issues.append(ConfigIssue(".".join(parts[: depth + 1]), child, "is a value, not a section"))
            return
        node = child
    # Overrides are typed as YAML; keep the user's raw text for string fields (e.g. a path "007").
    node[parts[-1]] = _RawOverride(value, text)


_INVALID = object()  # a value that failed its type check: the field keeps its default


@dataclasses.dataclass(frozen=True)
class _RawOverride:
    value: Any
    text: str


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type, raw: Any, prefix: str, issues: list[ConfigIssue]) -> Any:
    if isinstance(raw, _RawOverride):
        raw = raw.value
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        issues.append(ConfigIssue(prefix or "<config>", raw, "must be a section (a mapping)"))
        return cls()
    raw = dict(raw)
    names = [f.name for f in dataclasses.fields(cls)]
    if "megatron" in names:
        _move_megatron_aliases(raw)
    for key in raw:
        if key not in names:
            where = f"{prefix}.{key}" if prefix else str(key)
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(names)}"
            issues.append(ConfigIssue(where, _plain(raw[key]), f"unknown key{hint}"))
    hints = _hints(cls)
    values = {}
    for name in names:
        if name in raw:
            where = f"{prefix}.{name}" if prefix else name
            value = _coerce(hints[name], raw[name], where, issues)
            if value is not _INVALID:
                values[name] = value
    return cls(**values)


def _move_megatron_aliases(raw: dict[str, Any]) -> None:
    aliases = [key for key in raw if key in _MEGATRON_FIELDS]
    if not aliases:
        return
    section = raw.get("megatron")
    section = dict(section.value if isinstance(section, _RawOverride) else (section or {}))
    for key in aliases:
        section.setdefault(key, raw.pop(key))
    raw["megatron"] = section


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, _RawOverride) else value


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, where: str, issues: list[ConfigIssue]) -> Any:
    raw_text = value.text if isinstance(value, _RawOverride) else None
    value = _plain(value)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        inner = options[0] if len(options) == 1 else tp
        return _coerce(inner, _RawOverride(value, raw_text) if raw_text is not None else value, where, issues)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where, issues)
    if origin is list:
        (item_type,) = typing.get_args(tp)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]  # a single path for a list-of-paths field is what users mean
        if not isinstance(value, list):
            issues.append(ConfigIssue(where, value, f"must be a list of {_type_name(item_type)}"))
            return _INVALID
        items = [_coerce(item_type, item, f"{where}[{i}]", issues) for i, item in enumerate(value)]
        return _INVALID if any(item is _INVALID for item in items) else items
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-6" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if raw_text is not None:
            return raw_text.strip()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    elif tp is typing.Any:
        return value
    issues.append(ConfigIssue(where, value, f"must be {_type_name(tp)}, got {type(value).__name__}"))
    return _INVALID
