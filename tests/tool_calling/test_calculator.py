"""The calculator against Python's own arithmetic; what it refuses; the schema checker against jsonschema."""
from __future__ import annotations

import jsonschema  # installed with Ray; the reference for the JSON-schema subset, not used by hybridrl
import pytest

from hybridrl.tool_calling import CalculatorError, ToolSchemaError, argument_errors, check_tool_schema, evaluate

CASES = ["1 + 2 * 3", "(1 + 2) * 3", "7 / 2", "7 // 2", "-7 // 2", "7 % 3", "-7 % 3", "2 ** 10", "2 ** -2",
         "2 ** 0.5", "-(3 - 10) * +2", "1.5e3 / 4", "((((2))))", "10 - 2 - 3", "2 ** 3 ** 2", "123456789 * 987654321",
         "0.1 + 0.2", "3 ** 200", "-2 ** 2", "(-8) % 3.5", "-" * 99 + "1"]


@pytest.mark.parametrize("expression", CASES)
def test_calculator_equals_python_arithmetic(expression):
    expected = eval(expression, {"__builtins__": {}})  # the reference: the same literals, Python's rules
    value = evaluate(expression)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("expression, message", [
    ("x + 1", "names are not allowed"),
    ("(1).real", "attributes are not allowed"),
    ("abs(-1)", "function calls are not allowed"),
    ("__import__('os').system('true')", "function calls are not allowed"),
    ("[1, 2]", "List syntax are not allowed"),
    ("1 < 2", "Compare syntax are not allowed"),
    ("'a' * 3", "only numbers are allowed"),
    ("True + 1", "only numbers are allowed"),
    ("9 ** 9 ** 9", "too large"),
    ("10 ** 100000", "too large"),
    ("(10 ** 2000) * (10 ** 2000)", "too large"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("1e308 * 10", "not finite"),
    ("2.0 ** 5000", "too large for a float"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 +", "not an expression"),
    ("1" * 2000, "longer than 1000"),
    ("-" * 200 + "1", "nested deeper than 100"),
    ("1" + " + 1" * 150, "nested deeper than 100"),
    ("(" * 300 + "1" + ")" * 300, "not an expression: too many nested parentheses"),
])
def test_calculator_refuses(expression, message):
    with pytest.raises(CalculatorError, match=message.replace("(", r"\(").replace("*", r"\*")):
        evaluate(expression)


PARAMETERS = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 10},
        "x": {"type": "number", "exclusiveMinimum": 0},
        "s": {"type": "string", "minLength": 1, "maxLength": 3},
        "mode": {"type": "string", "enum": ["a", "b"]},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "opt": {"type": ["string", "null"]},
        "sub": {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"],
                "additionalProperties": False},
    },
    "required": ["n"],
}
ARGUMENTS = [
    {"n": 3}, {"n": 3.0}, {"n": 3.5}, {"n": True}, {"n": -1}, {"n": 11}, {}, {"n": "3"},
    {"n": 1, "x": 0}, {"n": 1, "x": 0.1}, {"n": 1, "s": ""}, {"n": 1, "s": "abcd"}, {"n": 1, "s": "ab"},
    {"n": 1, "mode": "c"}, {"n": 1, "mode": "a"}, {"n": 1, "flags": [True, False]}, {"n": 1, "flags": [1]},
    {"n": 1, "flags": [True, True, True]}, {"n": 1, "opt": None}, {"n": 1, "opt": 2},
    {"n": 1, "sub": {"k": 1}}, {"n": 1, "sub": {}}, {"n": 1, "sub": {"k": 1, "z": 2}}, {"n": 1, "other": 5},
]


@pytest.mark.parametrize("arguments", ARGUMENTS, ids=[str(a) for a in ARGUMENTS])
def test_argument_check_agrees_with_jsonschema(arguments):
    reference = jsonschema.Draft202012Validator(PARAMETERS).is_valid(arguments)
    assert (argument_errors(PARAMETERS, arguments) == []) == reference


def test_argument_errors_name_the_path():
    assert argument_errors(PARAMETERS, {"n": "3", "sub": {"k": "x"}}) == [
        "arguments.n: expected integer, got str '3'", "arguments.sub.k: expected integer, got str 'x'"]
    assert argument_errors(PARAMETERS, {}) == ["arguments: missing required 'n'"]


def _tool(**function):
    return {"type": "function", "function": {"name": "t", "description": "d", **function}}


@pytest.mark.parametrize("schema, message", [
    ({"type": "tool", "function": {}}, "tool.type: must be 'function'"),
    (_tool(name="bad name"), "tool.function.name: 'bad name' is not"),
    (_tool(description=""), "tool.function.description: a non-empty string"),
    (_tool(parameters={"type": "array"}), "tool.function.parameters.type: must be 'object'"),
    (_tool(parameters={"type": "object", "properties": {"x": {"type": "int"}}}),
     "tool.function.parameters.properties.x.type: 'int' is not a JSON type"),
    (_tool(parameters={"type": "object", "properties": {"x": {"oneOf": []}}}),
     r"tool.function.parameters.properties.x: unsupported schema keyword\(s\) \['oneOf'\]"),
    (_tool(parameters={"type": "object", "properties": {}, "required": ["y"]}),
     r"tool.function.parameters.required: \['y'\] not in"),
    (_tool(paramters={}), r"tool.function: unknown key\(s\) \['paramters'\]"),
])
def test_tool_schema_errors_name_the_field(schema, message):
    with pytest.raises(ToolSchemaError, match=message):
        check_tool_schema(schema)


def test_a_good_schema_is_also_a_valid_json_schema():
    schema = _tool(parameters=PARAMETERS)
    assert check_tool_schema(schema) == "t"
    jsonschema.Draft202012Validator.check_schema(PARAMETERS)
