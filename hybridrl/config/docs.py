"""Render the schema as a commented YAML file: the documented base config is generated, not typed.

`configs/base.yaml` is this function's output (a test keeps them equal), so every field, default
and description shown to users comes from `schema.py`, the single source.
"""
from __future__ import annotations

import dataclasses
import typing

import yaml

from hybridrl.config.schema import JobConfig, choices_of

HEADER = """\
# hybridrl base config: every field with its default and meaning.
# Generated from hybridrl/config/schema.py by `python -m hybridrl.config.docs > configs/base.yaml`.
# A job config names only what it changes; `hybridrl plan CONFIG` shows every derived number.
# Overrides (`a.b.c=value`) beat the file; a mapping (`section={a: 1}`) sets only the fields it names.
# A role's megatron fields may also be written on the role itself (actor_rollout_ref.actor.
# tensor_model_parallel_size is actor_rollout_ref.actor.megatron.tensor_model_parallel_size): the
# command line beats the file whichever spelling either uses; two different values for the two
# spellings within one source (the file, or the command line) are an error naming both.
# Settings the workers cannot honour yet (context_parallel_size > 1 on cuda, ...) are refused by the plan.
"""


def _scalar(value: typing.Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def render_base_yaml(root: typing.Any = None) -> str:
    root = root if root is not None else JobConfig()
    lines = [HEADER]

    def walk(obj: typing.Any, indent: int) -> None:
        pad = "  " * indent
        hints = typing.get_type_hints(type(obj))
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            comment = field.metadata.get("doc", "")
            found = choices_of(hints[field.name])
            if found is not None:  # the closed vocabulary, from the same Literal validation checks
                comment = f"{comment} [{' | '.join(typing.get_args(found[0]))}]"
            if dataclasses.is_dataclass(value):
                lines.append(f"{pad}{field.name}:{f'  # {comment}' if comment else ''}")
                walk(value, indent + 1)
            else:
                lines.append(f"{pad}{field.name}: {_scalar(value)}{f'  # {comment}' if comment else ''}")

    for field in dataclasses.fields(root):
        section = getattr(root, field.name)
        lines.append(f"{field.name}:  # {field.metadata.get('doc', '')}")
        walk(section, 1)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(render_base_yaml(), end="")
