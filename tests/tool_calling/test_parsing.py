"""The Hermes/Qwen tool-call parser against hand-written expected calls and errors; the parser registry."""
from __future__ import annotations

import sys

import pytest

from hybridrl.tool_calling import ToolCall, ToolCallError, UnknownParserError, available_parsers, get_parser


def parse(text: str):
    return get_parser("hermes").parse(text)


def test_several_calls_with_text_around_them():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>'
            ' and <tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>\nDone.')
    turn = parse(text)
    assert turn.content == "Let me compute.\n and \nDone."
    assert [(c.name, dict(c.arguments), c.index) for c in turn.calls] == [
        ("calculator", {"expression": "3*4"}, 0), ("python", {"code": "print(1)"}, 1)]
    assert turn.errors == [] and turn.has_tool_calls


def test_no_call_is_a_final_answer():
    turn = parse("The answer is 12.")
    assert (turn.content, turn.calls, turn.errors, turn.has_tool_calls) == ("The answer is 12.", [], [], False)


@pytest.mark.parametrize("body, message", [
    ('{"name": "calculator", "arguments": {"expression": "1+"}', "tool call 0 is not valid JSON: Expecting ',' "
                                                                  "delimiter: line 1 column 57 (char 56)"),
    ('{"arguments": {"expression": "1"}}', "tool call 0 has no 'name' (a non-empty string); got None"),
    ('{"name": "", "arguments": {}}', "tool call 0 has no 'name' (a non-empty string); got ''"),
    ('{"name": "calculator", "arguments": "1+1"}', "tool call 0 (calculator): 'arguments' must be a JSON object, "
                                                   "got str"),
    ('{"name": "calculator", "arguments": [1]}', "tool call 0 (calculator): 'arguments' must be a JSON object, "
                                                 "got list"),
    ('["calculator"]', "tool call 0 must be a JSON object with 'name' and 'arguments', got list"),
])
def test_malformed_calls_are_errors_not_exceptions(body, message):
    turn = parse(f"x <tool_call>{body}</tool_call> y")
    assert turn.calls == []
    assert turn.errors == [ToolCallError(0, message, body)]
    assert turn.content == "x  y"


def test_a_bad_call_between_good_ones_keeps_the_order():
    turn = parse('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>'
                 '<tool_call>{"name": "b"}</tool_call>')
    assert [(c.index, c.name) for c in turn.calls] == [(0, "a"), (2, "b")]
    assert turn.calls[1].arguments == {}  # no "arguments": a call without any
    assert [e.index for e in turn.errors] == [1]
    assert turn.errors[0].message.startswith("tool call 1 is not valid JSON")


def test_an_unclosed_call_is_an_error():
    turn = parse('ok <tool_call>{"name": "a", "arguments": {}} <tool_call>{"name": "b", "arguments": {}}</tool_call>'
                 ' <tool_call>{"name": "c"')
    assert [(c.index, c.name) for c in turn.calls] == [(1, "b")]
    assert [(e.index, e.message) for e in turn.errors] == [
        (0, "tool call 0 has no closing </tool_call>"), (2, "tool call 2 has no closing </tool_call>")]
    assert turn.errors[0].raw == '{"name": "a", "arguments": {}}'


def test_nested_json_and_tags_inside_strings():
    body = '{"name": "python", "arguments": {"code": "d = {\\"k\\": [1, {\\"z\\": 2}]}\\nprint(d)"}}'
    turn = parse(f"<tool_call>{body}</tool_call>")
    assert turn.calls == [ToolCall("python", {"code": 'd = {"k": [1, {"z": 2}]}\nprint(d)'}, 0, body)]


def test_deeply_nested_json_does_not_raise():
    turn = parse("<tool_call>" + "[" * 100_000 + "</tool_call>")
    assert turn.calls == [] and len(turn.errors) == 1


def test_an_integer_past_pythons_digit_limit_is_a_parse_error_not_an_exception():
    """A model's argument with 5000 digits: json raises a plain ValueError (Python's int-to-str digit limit), which
    escaped the parser and ended the rollout. Now the call's own error; the call beside it still runs."""
    limit = sys.get_int_max_str_digits()
    body = '{"name": "calculator", "arguments": {"expression": ' + "9" * (limit + 700) + "}}"
    turn = parse(f'<tool_call>{body}</tool_call><tool_call>{{"name": "a"}}</tool_call>')
    assert [(c.index, c.name) for c in turn.calls] == [(1, "a")]
    assert [e.index for e in turn.errors] == [0]
    assert turn.errors[0].message.startswith("tool call 0 is not valid JSON: Exceeds the limit")


def test_parser_registry_names_the_valid_parsers():
    assert "hermes" in available_parsers()
    with pytest.raises(UnknownParserError, match=r"unknown tool-call parser 'herms'\. Did you mean 'hermes'\? "
                                                 r"Valid names: hermes"):
        get_parser("herms")
