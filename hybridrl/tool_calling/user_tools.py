"""User tools loaded from a Python file (``tools_file``), next to the built-in ones.

The file is imported and run as ordinary Python: it is TRUSTED CODE with the trainer's full
permissions (the sandbox is for the model's code, not for yours). Only point the config at files you
wrote or reviewed. The file defines ``TOOL_SCHEMAS``, a list of OpenAI-style tool schemas, and for
each schema a function of the same name taking the schema's properties as keyword arguments and
returning text (or anything JSON-serializable)::

    TOOL_SCHEMAS = [{"type": "function", "function": {"name": "lookup", "description": "...",
                     "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                                    "required": ["key"]}}}]

    def lookup(key: str) -> str: ...

A function may also take a parameter named ``sample`` (not in its schema): it receives the calling
sample's data row (``ground_truth``, ``extra_info``, ...; `hybridrl.tool_calling.registry.SAMPLE_PARAMETER`).
The file may define ``TOOL_PARSERS``, a dict of tool-call parser names to parser classes (no-argument
classes with ``parse(text) -> ParsedTurn``), for models that write calls in their own format;
``multi_turn.tool_parser`` can then name one.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType

from hybridrl.tool_calling.parsing import registered_parser, replace_parser
from hybridrl.tool_calling.registry import Tool
from hybridrl.tool_calling.schema import ToolSchemaError, check_tool_schema
from hybridrl.user_code import import_user_file


class ToolFileError(RuntimeError):
    """A tools file that cannot be loaded or does not define the tools asked for; the message says which."""


def load_user_tools(path: str | Path, names: Iterable[str] | None = None) -> list[Tool]:
    """The tools `names` (all when None) defined in the file `path` (trusted code: it is executed); the
    file's `TOOL_PARSERS` are registered as tool-call parsers on the way."""
    path = Path(path)
    module = import_user_file(path, what="tools file", prefix="hybridrl_user_tools_", error=ToolFileError)
    _register_file_parsers(path, module)
    schemas = getattr(module, "TOOL_SCHEMAS", None)
    if not isinstance(schemas, (list, tuple)):
        raise ToolFileError(f"tools file {str(path)!r} must define TOOL_SCHEMAS, a list of tool schemas; "
                            f"got {type(schemas).__name__ if schemas is not None else 'nothing'}")
    by_name: dict[str, Tool] = {}
    for i, schema in enumerate(schemas):
        where = f"{path}: TOOL_SCHEMAS[{i}]"
        try:
            name = check_tool_schema(schema, where=where)
        except ToolSchemaError as error:
            raise ToolFileError(str(error)) from None
        function = getattr(module, name, None)
        if function is None or not callable(function):
            raise ToolFileError(f"{where} names tool {name!r} but the file defines no function {name!r}")
        if name in by_name:
            raise ToolFileError(f"{where}: tool {name!r} is defined twice")
        try:
            by_name[name] = Tool(schema, function)
        except ToolSchemaError as error:
            raise ToolFileError(f"{where}: {error}") from None
    wanted = list(by_name) if names is None else list(names)
    missing = [n for n in wanted if n not in by_name]
    if missing:
        raise ToolFileError(f"tools file {str(path)!r} has no tool(s) {missing}; tools defined there: "
                            f"{sorted(by_name)}")
    return [by_name[n] for n in wanted]


def _register_file_parsers(path: Path, module: ModuleType) -> None:
    parsers = getattr(module, "TOOL_PARSERS", {})
    valid = isinstance(parsers, Mapping) and all(isinstance(n, str) and n and callable(f) for n, f in parsers.items())
    if not valid:
        raise ToolFileError(f"tools file {str(path)!r}: TOOL_PARSERS must be a dict of parser names to parser "
                            f"classes; got {parsers!r}")
    for name, factory in parsers.items():
        owner = registered_parser(name)
        # the same file imported again (each import makes new classes) replaces its own parsers only
        if owner is not None and getattr(owner, "__module__", None) != module.__name__:
            raise ToolFileError(f"tools file {str(path)!r}: TOOL_PARSERS names {name!r}, which is already the "
                                f"parser {owner.__qualname__}; choose another name")
        replace_parser(name, factory)
