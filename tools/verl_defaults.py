#!/usr/bin/env python
"""Write hybridrl/config/verl_default_values.py: verl's default of each key of its trainer config that hybridrl has
no field for, read from verl's own generated trainer YAMLs in its wheel (the Megatron and the FSDP trainer's).

    python tools/fetch_verl_wheel.py && python tools/verl_defaults.py
    # tests/config/test_verl_file.py fails while the table and the wheel (or hybridrl's schema) differ

Only keys without a hybridrl field are kept (a key the schema reads keeps its meaning and needs no default here);
apart, the hybridrl fields whose verl default is null where hybridrl's field takes no null: verl's legacy sections
(`reward_model.enable: null`) mean "not set" by it. A default that is an interpolation is kept as written: it is
resolved within the user's own config when compared. A key whose default differs between the two trainers keeps
both (a tuple).
"""
from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hybridrl.config.loader import _leaves, canonical_path  # noqa: E402
from hybridrl.config.schema import JobConfig, without_none  # noqa: E402
from hybridrl.config.verl_interpolation import InterpolatedConfig  # noqa: E402
from hybridrl.config.verl_keys import verl_key  # noqa: E402
from tools.fetch_verl_wheel import FSDP_YAML, MEGATRON_YAML, VERL_VERSION, ensure_verl_wheel, read_member  # noqa: E402

OUT = REPO / "hybridrl" / "config" / "verl_default_values.py"


def field_hint(parts: tuple[str, ...]) -> Any | None:
    """The type of the hybridrl field a dotted path names (`typing.Any` inside a mapping field such as
    `override_transformer_config`, which hands any name to megatron); None for a path the schema lacks."""
    cls: Any = JobConfig
    parts = canonical_path(parts)
    for depth, part in enumerate(parts):
        if not dataclasses.is_dataclass(cls):
            return typing.Any if typing.get_origin(cls) is dict else None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        if depth == len(parts) - 1:
            return hints[part]
        cls = without_none(hints[part])
    return None


def takes_null(hint: Any) -> bool:
    return hint is typing.Any or type(None) in typing.get_args(hint) or typing.get_origin(hint) is dict


def without_hybridrl_field(parts: tuple[str, ...]) -> bool:
    """Whether no hybridrl field reads this key: verl's own keys, `verl_keys`' entries and hydra's `_target_`."""
    return parts[-1] == "_target_" or verl_key(parts) is not None or field_hint(parts) is None


def null_unset(parts: tuple[str, ...], default: Any) -> bool:
    """A hybridrl field whose verl default is null where hybridrl's field takes no null: verl's legacy sections
    (`reward_model.enable: null`) mean "not set" by it."""
    hint = field_hint(parts)
    return default is None and hint is not None and not takes_null(hint) and not dataclasses.is_dataclass(hint)


def _trainer_leaves(wheel: Path, resolved: bool = False) -> list[tuple[tuple[str, ...], Any]]:
    """Both trainers' keys and defaults, as written or with their interpolations `resolved`: the Megatron trainer's
    first (hybridrl trains with megatron-core)."""
    trees = [yaml.safe_load(read_member(wheel, member)) for member in (MEGATRON_YAML, FSDP_YAML)]
    if resolved:
        trees = [InterpolatedConfig(tree).resolved([]) for tree in trees]
    return [leaf for tree in trees for leaf in _leaves(tree)]


def table(wheel: Path) -> dict[str, Any]:
    """Each key of either trainer's YAML without a hybridrl field -> its default: the Megatron trainer's where both
    have the key (the FSDP trainer's other default, `critic.strategy: fsdp`, is a setting hybridrl does not run),
    except a `_target_`, which keeps both trainers' classes (a tuple)."""
    merged: dict[str, Any] = {}
    for parts, value in _trainer_leaves(wheel):
        if not without_hybridrl_field(parts):
            continue
        key = ".".join(parts)
        if key not in merged:
            merged[key] = value
        elif parts[-1] == "_target_" and merged[key] != value:
            merged[key] = (merged[key], value)
    return dict(sorted(merged.items()))


def nulls(wheel: Path) -> list[str]:
    """The hybridrl fields whose verl default (the Megatron trainer's, resolved) is a null that means "not set"."""
    seen: dict[str, Any] = {}
    for parts, value in _trainer_leaves(wheel, resolved=True):
        if not without_hybridrl_field(parts):
            seen.setdefault(".".join(parts), (parts, value))
    return sorted(key for key, (parts, value) in seen.items() if null_unset(parts, value))


def render(defaults: dict[str, Any], unset: list[str]) -> str:
    lines = [
        "# ruff: noqa: E501 - generated data, one key a line",
        '"""verl\'s default of each key of its trainer config that hybridrl has no field for (generated by',
        f"tools/verl_defaults.py from verl {VERL_VERSION}'s generated Megatron and FSDP trainer YAMLs; do not edit).",
        "A tuple holds the two trainers' `_target_` classes where they differ; a string with `${` is verl's",
        "interpolation, resolved within the config it is compared in (`hybridrl.config.verl_defaults`).",
        "VERL_NULL_UNSET: hybridrl fields whose verl default is a null that means \"not set\" (verl's legacy",
        'sections), where hybridrl\'s field takes no null."""',
        "from typing import Any",
        "",
        f'VERL_VERSION = "{VERL_VERSION}"',
        "VERL_DEFAULTS: dict[str, Any] = {",
        *(f"    {key!r}: {value!r}," for key, value in defaults.items()),
        "}",
        "VERL_NULL_UNSET: frozenset[str] = frozenset({",
        *(f"    {key!r}," for key in unset),
        "})",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    wheel = ensure_verl_wheel(quiet=True)
    OUT.write_text(render(table(wheel), nulls(wheel)))
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
