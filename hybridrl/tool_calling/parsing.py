"""Tool calls read out of a model turn: the Hermes/Qwen ``<tool_call>{json}</tool_call>`` format, and a
registry of parsers by name (``get_parser("hermes")``), like the reward scorers' registry.

A parser never raises on model text: every ``<tool_call>`` block becomes either a `ToolCall` or a
`ToolCallError` (malformed JSON, no name, arguments that are not an object, a block never closed),
both carrying the block's position among the turn's calls, so the agent loop can answer each one
in order.
"""
from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any]
    index: int  # position among the turn's tool-call blocks
    raw: str = ""  # the block's text between the tags, for logs


@dataclass(frozen=True)
class ToolCallError:
    index: int
    message: str
    raw: str = ""


@dataclass(frozen=True)
class ParsedTurn:
    content: str  # the turn's text outside the tool-call blocks, stripped
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)

    @property
    def has_tool_calls(self) -> bool:
        """Whether the model asked for any tool (a malformed call counts: it gets an error observation)."""
        return bool(self.calls or self.errors)


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


class UnknownParserError(KeyError):
    """A tool-call parser name that is not registered; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


_PARSERS: dict[str, Callable[[], ToolCallParser]] = {}


def register_parser(name: str) -> Callable[[Callable[[], ToolCallParser]], Callable[[], ToolCallParser]]:
    """Decorator: register a parser factory (a class taking no arguments) under `name`."""

    def decorate(factory: Callable[[], ToolCallParser]) -> Callable[[], ToolCallParser]:
        owner = _PARSERS.get(name)
        if owner is not None and owner is not factory:
            raise ValueError(f"tool-call parser {name!r} is already registered to {owner.__qualname__}")
        _PARSERS[name] = factory
        return factory

    return decorate


def registered_parser(name: str) -> Callable[[], ToolCallParser] | None:
    return _PARSERS.get(name)


def replace_parser(name: str, factory: Callable[[], ToolCallParser]) -> None:
    """Register `factory` as `name`, replacing what was there (a tools file imported again)."""
    _PARSERS[name] = factory


def available_parsers() -> list[str]:
    return sorted(_PARSERS)


def get_parser(name: str) -> ToolCallParser:
    """A fresh parser registered as `name`; an unknown name fails here, at start-up."""
    if name not in _PARSERS:
        close = difflib.get_close_matches(name, list(_PARSERS), n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownParserError(
            f"unknown tool-call parser {name!r}.{hint} Valid names: {', '.join(available_parsers())}")
    return _PARSERS[name]()


def call_from_json(payload: str, index: int) -> ToolCall | ToolCallError:
    """One call object ``{"name": str, "arguments": {...}}``; a missing ``arguments`` is a call without any."""
    raw = payload.strip()
    try:
        value = json.loads(raw)
    # ValueError: JSONDecodeError, and an integer over Python's int-to-str digit limit (int_max_str_digits),
    # which json raises as a plain ValueError
    except (ValueError, RecursionError) as error:
        return ToolCallError(index, f"tool call {index} is not valid JSON: {error}", raw)
    if not isinstance(value, dict):
        return ToolCallError(index, f"tool call {index} must be a JSON object with 'name' and 'arguments', "
                                    f"got {type(value).__name__}", raw)
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCallError(index, f"tool call {index} has no 'name' (a non-empty string); got {name!r}", raw)
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return ToolCallError(index, f"tool call {index} ({name}): 'arguments' must be a JSON object, "
                                    f"got {type(arguments).__name__}", raw)
    return ToolCall(name.strip(), arguments, index, raw)


@register_parser("hermes")
class HermesToolCallParser:
    """Qwen2.5/Qwen3 and Hermes chat templates: each call is ``<tool_call>{json}</tool_call>``."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        outside: list[str] = []
        position, index = 0, 0
        pattern = re.compile(re.escape(self.open_tag))
        while (match := pattern.search(text, position)) is not None:
            outside.append(text[position:match.start()])
            end = text.find(self.close_tag, match.end())
            # A second opening before this block's close means this one was never closed.
            next_open = text.find(self.open_tag, match.end())
            if end < 0 or (0 <= next_open < end):
                stop = next_open if next_open >= 0 else len(text)
                errors.append(ToolCallError(index, f"tool call {index} has no closing {self.close_tag}",
                                            text[match.end():stop].strip()))
                position, index = stop, index + 1
                continue
            parsed = call_from_json(text[match.end():end], index)
            (calls if isinstance(parsed, ToolCall) else errors).append(parsed)  # type: ignore[arg-type]
            position, index = end + len(self.close_tag), index + 1
        outside.append(text[position:])
        return ParsedTurn("".join(outside).strip(), calls, errors)
