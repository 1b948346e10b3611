"""OpenAI-style tool schemas and the JSON-schema subset tool parameters use, checked without a dependency.

A tool schema is what a chat template's ``tools=`` takes::

    {"type": "function", "function": {"name": "calculator", "description": "...",
                                      "parameters": {"type": "object", "properties": {...}, "required": [...]}}}

`check_tool_schema` refuses a schema outside the subset (naming the path of the field, e.g.
``function.parameters.properties.x.type``), so no keyword is silently ignored; `argument_errors`
checks a call's arguments against the parameters with JSON Schema's meaning of each keyword.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# Keywords that only describe (a chat template shows them; validation does not read them).
_ANNOTATIONS = {"description", "title", "default", "examples"}
_KEYWORDS = _ANNOTATIONS | {"type", "properties", "required", "additionalProperties", "items", "enum",
                            "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength",
                            "maxLength", "minItems", "maxItems"}
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolSchemaError(ValueError):
    """A tool schema outside what hybridrl understands; the message names the field's path."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _has_type(value: Any, kind: str) -> bool:
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    if kind == "string":
        return isinstance(value, str)
    if kind == "number":
        return _is_number(value)
    if kind == "integer":  # JSON Schema: 3.0 is an integer
        return _is_number(value) and (isinstance(value, int) or (math.isfinite(value) and value.is_integer()))
    if kind == "boolean":
        return isinstance(value, bool)
    return value is None


def check_value_schema(schema: Any, path: str) -> None:
    """Refuse a parameter schema that uses a keyword or a value outside the subset."""
    if not isinstance(schema, dict):
        raise ToolSchemaError(f"{path}: a schema must be an object, got {type(schema).__name__}")
    unknown = sorted(set(schema) - _KEYWORDS)
    if unknown:
        raise ToolSchemaError(f"{path}: unsupported schema keyword(s) {unknown}; supported: {sorted(_KEYWORDS)}")
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        bad = [k for k in kinds if k not in JSON_TYPES]
        if bad or not kinds:
            raise ToolSchemaError(f"{path}.type: {schema['type']!r} is not a JSON type; valid: {list(JSON_TYPES)}")
    if "properties" in schema:
        if not isinstance(schema["properties"], dict):
            raise ToolSchemaError(f"{path}.properties: must be an object of schemas")
        for name, sub in schema["properties"].items():
            check_value_schema(sub, f"{path}.properties.{name}")
    if "required" in schema:
        required = schema["required"]
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ToolSchemaError(f"{path}.required: must be a list of property names, got {required!r}")
        missing = [r for r in required if r not in schema.get("properties", {})]
        if missing:
            raise ToolSchemaError(f"{path}.required: {missing} not in {path}.properties")
    extra = schema.get("additionalProperties", True)
    if not isinstance(extra, bool):
        check_value_schema(extra, f"{path}.additionalProperties")
    if "items" in schema:
        check_value_schema(schema["items"], f"{path}.items")
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        raise ToolSchemaError(f"{path}.enum: must be a non-empty list, got {schema['enum']!r}")
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        if key in schema and not _is_number(schema[key]):
            raise ToolSchemaError(f"{path}.{key}: must be a number, got {schema[key]!r}")
    for key in ("minLength", "maxLength", "minItems", "maxItems"):
        value = schema.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ToolSchemaError(f"{path}.{key}: must be a non-negative integer, got {value!r}")


def check_tool_schema(schema: Any, where: str = "tool") -> str:
    """The tool's name, after checking the whole schema; `where` prefixes every error's path."""
    if not isinstance(schema, dict):
        raise ToolSchemaError(f"{where}: a tool schema must be an object, got {type(schema).__name__}")
    if schema.get("type") != "function":
        raise ToolSchemaError(f"{where}.type: must be 'function', got {schema.get('type')!r}")
    unknown = sorted(set(schema) - {"type", "function"})
    if unknown:
        raise ToolSchemaError(f"{where}: unknown key(s) {unknown}; a tool schema has 'type' and 'function'")
    function = schema.get("function")
    if not isinstance(function, dict):
        raise ToolSchemaError(f"{where}.function: must be an object with name, description, parameters")
    unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise ToolSchemaError(f"{where}.function: unknown key(s) {unknown}; valid: description, name, parameters")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise ToolSchemaError(f"{where}.function.name: {name!r} is not 1-64 letters, digits, '_' or '-'")
    if not isinstance(function.get("description"), str) or not function["description"].strip():
        raise ToolSchemaError(f"{where}.function.description: a non-empty string is required (the model reads it)")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    check_value_schema(parameters, f"{where}.function.parameters")
    if parameters.get("type") != "object":
        raise ToolSchemaError(f"{where}.function.parameters.type: must be 'object', got {parameters.get('type')!r}")
    return name


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def value_errors(schema: Mapping[str, Any], value: Any, path: str) -> list[str]:
    """Every way `value` breaks `schema` (one of `check_value_schema`'s), each naming its path."""
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_has_type(value, k) for k in kinds):
            return [f"{path}: expected {' or '.join(kinds)}, got {_describe(value)}"]
    errors: list[str] = []
    if "enum" in schema and not any(value == e and type(value) is type(e) or
                                    (_is_number(value) and _is_number(e) and value == e) for e in schema["enum"]):
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if _is_number(value):
        for key, ok in (("minimum", lambda b: value >= b), ("maximum", lambda b: value <= b),
                        ("exclusiveMinimum", lambda b: value > b), ("exclusiveMaximum", lambda b: value < b)):
            if key in schema and not ok(schema[key]):
                errors.append(f"{path}: {value!r} breaks {key} {schema[key]}")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{path}: shorter than minLength {schema['minLength']}")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: longer than maxLength {schema['maxLength']}")
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(f"{path}: fewer than minItems {schema['minItems']}")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path}: more than maxItems {schema['maxItems']}")
        if "items" in schema:
            for i, item in enumerate(value):
                errors += value_errors(schema["items"], item, f"{path}[{i}]")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                errors.append(f"{path}: missing required {name!r}")
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            if name in properties:
                errors += value_errors(properties[name], item, f"{path}.{name}")
            elif extra is False:
                errors.append(f"{path}: unexpected {name!r}; allowed: {sorted(properties)}")
            elif isinstance(extra, dict):
                errors += value_errors(extra, item, f"{path}.{name}")
    return errors


def argument_errors(parameters: Mapping[str, Any], arguments: Any) -> list[str]:
    """A call's arguments checked against its tool's ``parameters`` schema ([] when they fit)."""
    return value_errors(parameters, arguments, "arguments")
