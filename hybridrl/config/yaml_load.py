"""YAML as hybridrl reads a user's files: `yaml.safe_load`, except that a mapping naming one key twice is an error.

PyYAML keeps the last of a repeated key without a word (a second `data:` section replaces the first whole, a
repeated `max_prompt_length:` takes the later value), so a setting the user wrote would be dropped silently. The
error names both lines."""
from __future__ import annotations

from typing import IO, Any

import yaml


class RepeatedKeyError(yaml.constructor.ConstructorError):
    """A mapping names one key twice."""


class _UniqueKeyLoader(yaml.SafeLoader):
    pass


def _mapping_without_repeats(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            first = seen[key].start_mark
            raise RepeatedKeyError(
                "while reading a mapping", node.start_mark,
                f"found the key {key!r} a second time (first on line {first.line + 1}): only one of them could "
                "count; keep one", key_node.start_mark)
        seen[key] = key_node
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_repeats)


def load_yaml(text: str | IO[str]) -> Any:
    """`yaml.safe_load(text)`, refusing a repeated key in any mapping (`yaml.YAMLError`, naming both lines)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
