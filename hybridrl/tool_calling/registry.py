"""Tools under their names, and the one way to run a model's call: `ToolRegistry.execute`.

Every problem the model causes is an observation, never an exception: a malformed call
(`ToolStatus.PARSE_ERROR`), a name no tool has (`UNKNOWN_TOOL`), arguments that break the schema or
the function's signature (`BAD_ARGUMENTS`), a tool that raises (`TOOL_ERROR`), runs past its time
(`TIMEOUT`) or prints more than the observation limit (`OUTPUT_TRUNCATED`, the head kept). The text is
what the agent loop appends as the tool's message; `ToolMetrics` counts calls, errors by kind and
tool time for the step's metrics.
"""
from __future__ import annotations

import enum
import inspect
import json
import multiprocessing
import pickle
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from types import MappingProxyType
from typing import Any

from hybridrl.tool_calling.parsing import ParsedTurn, ToolCall, ToolCallError
from hybridrl.tool_calling.schema import ToolSchemaError, argument_errors, check_tool_schema


class ToolStatus(enum.StrEnum):
    OK = "ok"
    PARSE_ERROR = "parse_error"
    UNKNOWN_TOOL = "unknown_tool"
    BAD_ARGUMENTS = "bad_arguments"
    TOOL_ERROR = "tool_error"
    TIMEOUT = "timeout"
    OUTPUT_TRUNCATED = "output_truncated"


@dataclass(frozen=True)
class ToolResult:
    """What a tool may return instead of plain text, to report its own status (the sandbox does)."""

    text: str
    status: ToolStatus = ToolStatus.OK


@dataclass(frozen=True)
class Observation:
    text: str
    status: ToolStatus
    name: str | None  # the tool called; None for a call that did not parse
    index: int  # the call's position in its turn
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status is ToolStatus.OK


@dataclass
class ToolMetrics:
    """Counts over any number of observations; `as_metrics` gives the ``tools/`` metrics."""

    calls: int = 0
    statuses: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    max_seconds: float = 0.0

    def add(self, observations: Iterable[Observation]) -> None:
        for observation in observations:
            self.calls += 1
            self.statuses[observation.status] += 1
            self.seconds += observation.seconds
            self.max_seconds = max(self.max_seconds, observation.seconds)

    @property
    def errors(self) -> int:
        return self.calls - self.statuses[ToolStatus.OK]

    def as_metrics(self) -> dict[str, float]:
        metrics = {"tools/calls": float(self.calls), "tools/errors": float(self.errors),
                   "tools/time_s": self.seconds, "tools/time_s_max": self.max_seconds}
        for status in ToolStatus:
            if status is not ToolStatus.OK:
                metrics[f"tools/errors/{status.value}"] = float(self.statuses[status])
        return metrics


# A tool function's keyword parameter of this name receives the calling sample's row (a read-only
# mapping: `index`, `uid`, `sample` (which of the prompt's n), `data_source`, `ground_truth`,
# `extra_info`): a tool that answers per problem (a lookup in the problem's documents, a checker of
# the problem's answer) reads it there. The model never sets it: it is not in the schema.
SAMPLE_PARAMETER = "sample"


@dataclass(frozen=True)
class Tool:
    schema: Mapping[str, Any]
    function: Callable[..., Any]
    name: str = ""
    # Wall-time limit of one call. With a limit each call runs in a forked process of its own, killed
    # past it (a thread cannot be stopped; a process can), so what a call changes in the tool's module
    # state is not kept. None: the call runs in the caller's thread, without a limit (the python tool's
    # sandbox keeps its own).
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        name = check_tool_schema(self.schema, where=f"tool {self.name or '?'}")
        if self.name and self.name != name:
            raise ToolSchemaError(f"tool {self.name!r}: its schema's function.name is {name!r}")
        object.__setattr__(self, "name", name)
        check_signature(self.schema["function"].get("parameters", {}), self.function, f"tool {name!r}")

    @property
    def reads_sample(self) -> bool:
        """The function takes the calling sample's row (a parameter named `SAMPLE_PARAMETER`)."""
        return SAMPLE_PARAMETER in inspect.signature(self.function).parameters

    @property
    def parameters(self) -> Mapping[str, Any]:
        return self.schema["function"].get("parameters", {"type": "object", "properties": {}})


def check_signature(parameters: Mapping[str, Any], function: Callable[..., Any], where: str) -> None:
    """The schema and the function agree: every property is a parameter, every parameter without a
    default is required (else a valid call would fail with TypeError)."""
    if not callable(function):
        raise ToolSchemaError(f"{where}: {type(function).__name__} is not callable")
    signature = inspect.signature(function)
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    named = {n for n, p in signature.parameters.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != SAMPLE_PARAMETER}
    properties = set(parameters.get("properties", {}))
    if SAMPLE_PARAMETER in properties:
        raise ToolSchemaError(f"{where}: the schema property {SAMPLE_PARAMETER!r} is reserved (a function's "
                              f"{SAMPLE_PARAMETER!r} parameter receives the calling sample's row, which the model "
                              "does not write); rename the property")
    if not takes_kwargs and properties - named:
        raise ToolSchemaError(f"{where}: schema properties {sorted(properties - named)} are not parameters of "
                              f"{getattr(function, '__name__', function)!r} (its parameters: {sorted(named)})")
    needed = {n for n in named if signature.parameters[n].default is inspect.Parameter.empty}
    unrequired = sorted(needed - set(parameters.get("required", [])))
    if unrequired:
        raise ToolSchemaError(f"{where}: parameters {unrequired} have no default, so the schema's "
                              "function.parameters.required must list them")


def _truncate(text: str, limit: int, side: str = "right") -> tuple[str, bool]:
    """`text` cut to `limit` characters and a note, keeping its first (`right`: the end is cut), last (`left`)
    or first and last `limit // 2` (`middle`) characters, as verl's tool_response_truncate_side does."""
    if len(text) <= limit:
        return text, False
    if side == "left":
        return f"[output truncated: {len(text)} characters, the last {limit} shown]\n" + text[-limit:], True
    if side == "middle":
        half = limit // 2
        return (text[:half] + f"\n[output truncated: {len(text)} characters, the first and last {half} shown]\n"
                + (text[-half:] if half else "")), True
    if side != "right":
        raise ValueError(f"truncate side {side!r}: must be left, middle or right")
    return text[:limit] + f"\n[output truncated: {len(text)} characters, the first {limit} shown]", True


class ToolRegistry:
    """The tools one job offers the model, by name."""

    def __init__(self, tools: Iterable[Tool] = (), max_observation_chars: int = 4096,
                 truncate_side: str = "right", max_parallel_calls: int | None = None) -> None:
        self._tools: dict[str, Tool] = {}
        self.max_observation_chars = max_observation_chars
        self.truncate_side = truncate_side  # which characters of a longer answer are kept (`_truncate`)
        self.max_parallel_calls = max_parallel_calls  # calls run per turn, the first written; None = all
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> None:
        if tool.name in self._tools:
            raise ValueError(f"tool {tool.name!r} is registered twice")
        self._tools[tool.name] = tool

    @property
    def names(self) -> list[str]:
        return sorted(self._tools)

    def __contains__(self, name: str) -> bool:
        return name in self._tools

    def schemas(self) -> list[Mapping[str, Any]]:
        """What the chat template's ``tools=`` takes, in registration order."""
        return [tool.schema for tool in self._tools.values()]

    def execute(self, call: ToolCall | ToolCallError, sample: Mapping[str, Any] | None = None) -> Observation:
        """Run one parsed call; every model-caused problem comes back as an error observation.
        `sample`: the calling sample's row, for a tool that reads it (`SAMPLE_PARAMETER`)."""
        if isinstance(call, ToolCallError):
            return Observation(f"Error: {call.message}", ToolStatus.PARSE_ERROR, None, call.index)
        tool = self._tools.get(call.name)
        if tool is None:
            return Observation(f"Error: unknown tool {call.name!r}; available tools: {', '.join(self.names)}",
                               ToolStatus.UNKNOWN_TOOL, call.name, call.index)
        arguments = dict(call.arguments)
        problems = argument_errors(tool.parameters, arguments)
        if SAMPLE_PARAMETER in arguments:  # the model cannot set the row a tool reads
            problems.append(f"{SAMPLE_PARAMETER!r} is not an argument of {call.name}")
        if tool.reads_sample:
            arguments[SAMPLE_PARAMETER] = MappingProxyType(dict(sample or {}))
        if not problems:
            try:
                inspect.signature(tool.function).bind(**arguments)
            except TypeError as error:
                problems = [str(error)]
        if problems:
            return Observation(f"Error: bad arguments for {call.name}: " + "; ".join(problems),
                               ToolStatus.BAD_ARGUMENTS, call.name, call.index)
        start = time.perf_counter()
        try:
            result = self._call(tool, arguments)
            if isinstance(result, ToolResult):
                text, status = result.text, result.status
            else:
                # inside the try: a result that does not serialize (a cycle, nesting past the recursion limit)
                # is the tool's failure, not the rollout's
                text, status = (result if isinstance(result, str) else json.dumps(result, default=str)), ToolStatus.OK
        except TimeoutError:
            return Observation(f"Error: {call.name} ran past its {tool.timeout_s} s limit", ToolStatus.TIMEOUT,
                               call.name, call.index, time.perf_counter() - start)
        except Exception as error:  # the tool's own failure is the model's observation
            return Observation(f"Error: {call.name} raised {type(error).__name__}: {error}", ToolStatus.TOOL_ERROR,
                               call.name, call.index, time.perf_counter() - start)
        seconds = time.perf_counter() - start
        text, cut = _truncate(text, self.max_observation_chars, self.truncate_side)
        if cut and status is ToolStatus.OK:
            status = ToolStatus.OUTPUT_TRUNCATED
        return Observation(text, status, call.name, call.index, seconds)

    def _call(self, tool: Tool, arguments: Mapping[str, Any]) -> Any:
        if tool.timeout_s is None:
            return tool.function(**arguments)
        return call_in_child(tool.function, arguments, tool.timeout_s)

    def execute_turn(self, turn: ParsedTurn, sample: Mapping[str, Any] | None = None) -> list[Observation]:
        """Every call of a model turn, in the order the model wrote them (parse errors included); with
        `max_parallel_calls`, only the first that many (the others are not run and get no answer, as in verl)."""
        ordered = sorted([*turn.calls, *turn.errors], key=lambda c: c.index)
        if self.max_parallel_calls is not None:
            ordered = ordered[:self.max_parallel_calls]
        return [self.execute(call, sample) for call in ordered]


def call_in_child(function: Callable[..., Any], arguments: Mapping[str, Any], timeout_s: float) -> Any:
    """`function(**arguments)` in a forked child, which is killed past `timeout_s` (`TimeoutError`); the
    child's exception is raised here (its type and message when it does not pickle)."""
    context = multiprocessing.get_context("fork")  # the tool's function and arguments need not pickle
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_serve_call, args=(function, arguments, send), name="hybridrl-tool")
    child.start()
    send.close()
    try:
        if not receive.poll(timeout_s):
            raise TimeoutError(f"ran past {timeout_s} s")
        try:
            ok, value = receive.recv()
        except EOFError:
            child.join(5)
            raise RuntimeError(f"its process ended without an answer (exit status {child.exitcode})") from None
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receive.close()
    if not ok:
        raise value
    return value


def _serve_call(function: Callable[..., Any], arguments: Mapping[str, Any], send: Connection) -> None:
    try:
        answer: tuple[bool, Any] = (True, function(**arguments))
    except Exception as error:  # the tool's failure travels to the caller
        answer = (False, error)
    try:
        send.send(answer)
    except (pickle.PicklingError, TypeError, AttributeError) as error:
        kind = "answer" if answer[0] else f"{type(answer[1]).__name__}: {answer[1]}"
        send.send((False, RuntimeError(f"its {kind} could not be sent back ({error})")))
    send.close()
