#!/usr/bin/env python
"""Write hybridrl/config/megatron_fields.py: megatron-core's TransformerConfig fields and the values each takes,
read from the installed megatron-core's own dataclass, so `hybridrl plan` (torch-free) can check
`override_transformer_config` names and values without importing megatron.

    python tools/megatron_fields.py          # after upgrading megatron-core; tests/test_config_megatron_fields.py
                                             # fails while the file and the installed megatron-core differ
"""
from __future__ import annotations

import dataclasses
import enum
import sys
import types
import typing
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "hybridrl" / "config" / "megatron_fields.py"
SIMPLE = {bool: "bool", int: "int", float: "float", str: "str", type(None): "none"}


def forms(tp: typing.Any) -> tuple[str, ...]:
    """The value forms a YAML value may take for annotation `tp` ("other": none a config can write)."""
    if tp in SIMPLE:
        return (SIMPLE[tp],)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return tuple(dict.fromkeys(f for arg in typing.get_args(tp) for f in forms(arg)))
    if origin is typing.Literal:
        return ("choice:" + "|".join(str(v) for v in typing.get_args(tp)),)
    if origin in (list, typing.List):  # noqa: UP006 - megatron's annotations use typing.List
        args = typing.get_args(tp)
        inner = forms(args[0]) if args else ("other",)
        return (f"list[{inner[0]}]",) if len(inner) == 1 and inner[0] in SIMPLE.values() else ("other",)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return (f"enum:{tp.__name__}:" + "|".join(member.name for member in tp),)
    return ("other",)


def config_forms(config_class: type) -> dict[str, tuple[str, ...]]:
    hints = typing.get_type_hints(config_class)
    return {f.name: forms(hints.get(f.name, f.type)) for f in dataclasses.fields(config_class) if f.init}


def _table(name: str, config_class: type) -> list[str]:
    lines = [f"{name}: dict[str, tuple[str, ...]] = {{"]
    for field, value_forms in sorted(config_forms(config_class).items()):
        lines.append(f"    {field!r}: {value_forms!r},".replace("'", '"'))
    return [*lines, "}"]


def render() -> str:
    import megatron.core
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    lines = [
        "# ruff: noqa: E501 - generated data, one field a line",
        '"""megatron-core\'s TransformerConfig, OptimizerConfig and DistributedDataParallelConfig fields and the value forms each takes (generated',
        "by tools/megatron_fields.py from the installed megatron-core; do not edit). A form is bool, int, float,",
        'str, none, list[<form>], choice:<a>|<b>, enum:<Enum>:<a>|<b>, or other (not writable in a config)."""',
        "",
        f'MEGATRON_CORE_VERSION = "{megatron.core.__version__}"',
        *_table("TRANSFORMER_CONFIG_FIELDS", TransformerConfig),
        *_table("OPTIMIZER_CONFIG_FIELDS", OptimizerConfig),
        *_table("DDP_CONFIG_FIELDS", DistributedDataParallelConfig),
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    OUT.write_text(render())
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
