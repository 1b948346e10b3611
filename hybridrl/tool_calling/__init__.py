"""Tools for multi-turn rollouts: parsing a model's tool calls, the tools themselves, running a call.

    from hybridrl.tool_calling import build_registry, get_parser
    registry = build_registry(["calculator", "python"])        # + tools_file= for user tools
    turn = get_parser("hermes").parse(model_text)               # calls and per-call parse errors
    observations = registry.execute_turn(turn)                  # never raises for the model's mistakes
    chat_template(..., tools=registry.schemas())

Pure Python: imports nothing of hybridrl but its own modules (the rollout package builds on it).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

from hybridrl.tool_calling import calculator as _calculator
from hybridrl.tool_calling import python_tool as _python_tool
from hybridrl.tool_calling.calculator import CalculatorError, evaluate
from hybridrl.tool_calling.parsing import (
    HermesToolCallParser,
    ParsedTurn,
    ToolCall,
    ToolCallError,
    UnknownParserError,
    available_parsers,
    get_parser,
    register_parser,
)
from hybridrl.tool_calling.python_tool import run_python
from hybridrl.tool_calling.registry import Observation, Tool, ToolMetrics, ToolRegistry, ToolResult, ToolStatus
from hybridrl.tool_calling.sandbox import (
    ISOLATIONS,
    Isolation,
    SandboxLimits,
    SandboxRun,
    SandboxUnavailable,
    run_sandboxed,
    sandbox_problem,
)
from hybridrl.tool_calling.schema import ToolSchemaError, argument_errors, check_tool_schema
from hybridrl.tool_calling.user_tools import ToolFileError, load_user_tools

BUILTIN_TOOLS = ("calculator", "python")


def builtin_tool(name: str, sandbox: SandboxLimits | None = None, isolation: Isolation = "namespaces") -> Tool:
    """A built-in tool by name; the python tool's sandbox runs under `sandbox` limits and `isolation`
    (`SandboxUnavailable` where the kernel cannot give namespaces)."""
    if name == "calculator":
        return Tool(_calculator.SCHEMA, _calculator.calculator)
    if name == "python":
        return Tool(_python_tool.SCHEMA, _python_tool.python_tool(sandbox, isolation))
    raise ToolFileError(f"unknown built-in tool {name!r}; built-in tools: {', '.join(BUILTIN_TOOLS)} "
                        "(other tools come from a tools file)")


def build_registry(names: Iterable[str], tools_file: str | Path | None = None,
                   sandbox: SandboxLimits | None = None, max_observation_chars: int = 4096,
                   isolation: Isolation = "namespaces", tool_timeout_s: float | None = None,
                   truncate_side: str = "right", max_parallel_calls: int | None = None) -> ToolRegistry:
    """The registry of `names`: built-in ones by name, the others from `tools_file` (each call of those
    in a process of its own, killed at `tool_timeout_s`, when that is set)."""
    names = list(names)
    user = [n for n in names if n not in BUILTIN_TOOLS]
    if user and tools_file is None:
        raise ToolFileError(f"tools {user} are not built in ({', '.join(BUILTIN_TOOLS)}) and no tools file is set")
    # the file is loaded even when every tool is built in: it may define the job's tool-call parser
    loaded = {t.name: t for t in load_user_tools(tools_file, user)} if tools_file is not None else {}
    if tool_timeout_s is not None:
        loaded = {n: dataclasses.replace(t, timeout_s=tool_timeout_s) for n, t in loaded.items()}
    tools = [loaded[n] if n in loaded else builtin_tool(n, sandbox, isolation) for n in names]
    return ToolRegistry(tools, max_observation_chars=max_observation_chars, truncate_side=truncate_side,
                        max_parallel_calls=max_parallel_calls)


__all__ = [
    "BUILTIN_TOOLS", "CalculatorError", "HermesToolCallParser", "ISOLATIONS", "Isolation", "Observation",
    "ParsedTurn", "SandboxLimits", "SandboxRun", "SandboxUnavailable", "Tool", "ToolCall", "ToolCallError",
    "ToolFileError", "ToolMetrics", "ToolRegistry", "ToolResult", "ToolSchemaError", "ToolStatus",
    "UnknownParserError", "argument_errors", "available_parsers", "build_registry", "builtin_tool",
    "check_tool_schema", "evaluate", "get_parser", "load_user_tools", "register_parser", "run_python",
    "run_sandboxed", "sandbox_problem",
]
