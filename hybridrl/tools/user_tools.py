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
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from hybridrl.tools.registry import Tool
from hybridrl.tools.schema import ToolSchemaError, check_tool_schema
from hybridrl.user_code import import_user_file


class ToolFileError(RuntimeError):
    """A tools file that cannot be loaded or does not define the tools asked for; the message says which."""


def load_user_tools(path: str | Path, names: Iterable[str] | None = None) -> list[Tool]:
    """The tools `names` (all when None) defined in the file `path` (trusted code: it is executed)."""
    path = Path(path)
    module = import_user_file(path, what="tools file", prefix="hybridrl_user_tools_", error=ToolFileError)
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
