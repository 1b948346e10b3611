"""Executing calls: every failure kind is its own status and observation; metrics; user tools from a file."""
from __future__ import annotations

import json
import time

import pytest

from hybridrl.tool_calling import (
    SandboxLimits,
    Tool,
    ToolCall,
    ToolFileError,
    ToolMetrics,
    ToolRegistry,
    ToolSchemaError,
    ToolStatus,
    build_registry,
    builtin_tool,
    get_parser,
    load_user_tools,
)


def _schema(name: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool",
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


def _boom(x: int) -> str:
    raise RuntimeError(f"boom {x}")


def _slow(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


@pytest.fixture
def registry():
    limits = SandboxLimits(wall_time_s=10, cpu_time_s=1, max_output_bytes=100_000)
    registry = build_registry(["calculator", "python"], sandbox=limits, max_observation_chars=200)
    registry.register(Tool(_schema("boom", {"x": {"type": "integer"}}, ["x"]), _boom))
    registry.register(Tool(_schema("slow", {"seconds": {"type": "number"}}, ["seconds"]), _slow, timeout_s=0.2))
    return registry


def _run(registry, text):
    return [(o.status, o.text, o.name, o.index) for o in registry.execute_turn(get_parser("hermes").parse(text))]


def _call(name, **arguments):
    return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments)}}}</tool_call>'


def test_each_failure_kind_is_its_own_observation(registry):
    text = "".join([
        _call("calculator", expression="6 * 7"),
        "<tool_call>{not json}</tool_call>",
        _call("search", query="x"),
        _call("calculator", expr="1"),
        _call("calculator", expression=5),
        _call("boom", x=3),
        _call("calculator", expression="x + 1"),
        _call("slow", seconds=2),
        _call("python", code="print('y' * 1000)"),
        _call("python", code="while True: pass"),
    ])
    got = _run(registry, text)
    assert [status for status, *_ in got] == [
        ToolStatus.OK, ToolStatus.PARSE_ERROR, ToolStatus.UNKNOWN_TOOL, ToolStatus.BAD_ARGUMENTS,
        ToolStatus.BAD_ARGUMENTS, ToolStatus.TOOL_ERROR, ToolStatus.TOOL_ERROR, ToolStatus.TIMEOUT,
        ToolStatus.OUTPUT_TRUNCATED, ToolStatus.TIMEOUT]
    assert [index for *_, index in got] == list(range(10))
    texts = [t for _, t, _, _ in got]
    assert texts[0] == "42"
    assert texts[1].startswith("Error: tool call 1 is not valid JSON: Expecting property name")
    assert texts[2] == "Error: unknown tool 'search'; available tools: boom, calculator, python, slow"
    assert texts[3] == ("Error: bad arguments for calculator: arguments: missing required 'expression'")
    assert texts[4] == "Error: bad arguments for calculator: arguments.expression: expected string, got int 5"
    assert texts[5] == "Error: boom raised RuntimeError: boom 3"
    assert texts[6] == ("Error: calculator raised CalculatorError: names are not allowed; only numbers, "
                        "+ - * / // % ** and parentheses")
    assert texts[7] == "Error: slow ran past its 0.2 s limit"
    assert texts[8] == "y" * 200 + "\n[output truncated: 1001 characters, the first 200 shown]"
    assert texts[9] in ("\n[timeout: CPU-time limit of 1 s]", "\n[timeout: wall-time limit of 10 s]")


def test_an_argument_the_function_does_not_take_is_bad_arguments(registry):
    [(status, text, _, _)] = _run(registry, _call("calculator", expression="1", precision=3))
    assert status is ToolStatus.BAD_ARGUMENTS
    assert text == "Error: bad arguments for calculator: got an unexpected keyword argument 'precision'"


def test_metrics_count_calls_errors_and_time(registry):
    metrics = ToolMetrics()
    metrics.add(registry.execute_turn(get_parser("hermes").parse(
        _call("calculator", expression="1+1") + _call("nope") + "<tool_call>[</tool_call>" +
        _call("slow", seconds=0.05))))
    got = metrics.as_metrics()
    assert {k: v for k, v in got.items() if not k.startswith("tools/time")} == {
        "tools/calls": 4.0, "tools/errors": 2.0, "tools/errors/parse_error": 1.0, "tools/errors/unknown_tool": 1.0,
        "tools/errors/bad_arguments": 0.0, "tools/errors/tool_error": 0.0, "tools/errors/timeout": 0.0,
        "tools/errors/output_truncated": 0.0}
    assert 0.05 <= got["tools/time_s_max"] <= got["tools/time_s"] < 1.0


def test_schemas_are_what_a_chat_template_takes(registry):
    assert [s["function"]["name"] for s in registry.schemas()] == ["calculator", "python", "boom", "slow"]
    # what a chat template's tools= takes: plain JSON, the same after a round trip
    assert json.loads(json.dumps(registry.schemas())) == registry.schemas()


def test_schema_and_function_must_agree():
    with pytest.raises(ToolSchemaError, match=r"schema properties \['y'\] are not parameters of '_boom'"):
        Tool(_schema("boom", {"x": {"type": "integer"}, "y": {"type": "integer"}}, ["x"]), _boom)
    with pytest.raises(ToolSchemaError, match=r"parameters \['x'\] have no default"):
        Tool(_schema("boom", {"x": {"type": "integer"}}, []), _boom)
    with pytest.raises(ToolFileError, match="unknown built-in tool 'search'"):
        builtin_tool("search")


GOOD = '''
TOOL_SCHEMAS = [
    {"type": "function", "function": {"name": "lookup", "description": "look a key up",
     "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}},
    {"type": "function", "function": {"name": "add", "description": "add two integers",
     "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"]}}},
]
TABLE = {"pi": "3.14159"}

def lookup(key):
    return TABLE[key]

def add(a, b):
    return {"sum": a + b}
'''


def test_user_tools_from_a_file(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(GOOD)
    registry = build_registry(["add", "calculator", "lookup"], tools_file=path)
    assert registry.names == ["add", "calculator", "lookup"]
    got = _run(registry, _call("add", a=2, b=3) + _call("lookup", key="pi") + _call("lookup", key="e"))
    assert got == [(ToolStatus.OK, '{"sum": 5}', "add", 0), (ToolStatus.OK, "3.14159", "lookup", 1),
                   (ToolStatus.TOOL_ERROR, "Error: lookup raised KeyError: 'e'", "lookup", 2)]
    assert [t.name for t in load_user_tools(path)] == ["lookup", "add"]


def test_user_tool_file_errors(tmp_path):
    with pytest.raises(ToolFileError, match=r"tools file '.*missing.py' does not exist"):
        load_user_tools(tmp_path / "missing.py")
    path = tmp_path / "tools.py"
    path.write_text(GOOD)
    with pytest.raises(ToolFileError, match=r"has no tool\(s\) \['search'\]; tools defined there: \['add', 'lookup'\]"):
        load_user_tools(path, ["lookup", "search"])
    with pytest.raises(ToolFileError, match=r"tools \['search'\] are not built in .* and no tools file is set"):
        build_registry(["search"])
    (tmp_path / "none.py").write_text("def lookup(key): return key\n")
    with pytest.raises(ToolFileError, match="must define TOOL_SCHEMAS, a list of tool schemas; got nothing"):
        load_user_tools(tmp_path / "none.py")
    (tmp_path / "nofn.py").write_text(GOOD.replace("def add(a, b)", "def plus(a, b)"))
    with pytest.raises(ToolFileError, match=r"TOOL_SCHEMAS\[1\] names tool 'add' but the file defines no function"):
        load_user_tools(tmp_path / "nofn.py")
    (tmp_path / "bad.py").write_text(GOOD.replace('"b": {"type": "integer"}', '"b": {"type": "int"}'))
    with pytest.raises(ToolFileError, match=r"bad.py: TOOL_SCHEMAS\[1\]\.function\.parameters\.properties\.b\.type: "
                                            r"'int' is not a JSON type"):
        load_user_tools(tmp_path / "bad.py")
    (tmp_path / "raises.py").write_text("raise ImportError('no such lib')\n")
    with pytest.raises(ToolFileError, match=r"importing tools file '.*raises.py' failed: ImportError\('no such lib'\)"):
        load_user_tools(tmp_path / "raises.py")
    (tmp_path / "old_name.py").write_text("from hybridrl.tools.parsing import ToolCall\n" + GOOD)
    with pytest.raises(ToolFileError, match=r"No module named 'hybridrl.tools'.* \(hybridrl.tools is now "
                                            r"hybridrl.tool_calling: import from hybridrl.tool_calling instead\)"):
        load_user_tools(tmp_path / "old_name.py")
    (tmp_path / "sig.py").write_text(GOOD.replace("def add(a, b)", "def add(a)"))
    with pytest.raises(ToolFileError, match=r"schema properties \['b'\] are not parameters of 'add'"):
        load_user_tools(tmp_path / "sig.py")


def test_a_call_object_is_executed_directly(registry):
    observation = registry.execute(ToolCall("calculator", {"expression": "2 ** 8"}, 0))
    assert (observation.text, observation.status, observation.ok) == ("256", ToolStatus.OK, True)


def test_the_config_defaults_are_the_tools_defaults():
    """The next slice builds the tools from `rollout.multi_turn`: its defaults must mean what the tools' mean."""
    import dataclasses
    import inspect

    from hybridrl.config.schema import MultiTurnConfig, SandboxConfig
    from hybridrl.tool_calling import available_parsers, python_tool

    config_limits = dataclasses.asdict(SandboxConfig())
    isolation = config_limits.pop("isolation")
    assert config_limits == dataclasses.asdict(SandboxLimits())
    assert isolation == inspect.signature(python_tool.python_tool).parameters["isolation"].default == "namespaces"
    config = MultiTurnConfig()
    assert config.tool_parser in available_parsers()
    assert config.max_observation_chars == build_registry([]).max_observation_chars


def test_a_tool_reads_its_calling_samples_row_which_the_model_cannot_set():
    seen = []

    def answer(key: str, sample) -> str:
        seen.append(dict(sample))
        return f"{key}={sample['ground_truth']}"

    tool = Tool(_schema("answer", {"key": {"type": "string"}}, ["key"]), answer)
    assert tool.reads_sample
    registry = ToolRegistry([tool])
    row = {"index": 7, "ground_truth": "42", "sample": 1}
    observation = registry.execute(ToolCall("answer", {"key": "x"}, 0), sample=row)
    assert (observation.status, observation.text) == (ToolStatus.OK, "x=42") and seen == [row]
    # the model writing `sample` itself is a bad call, whatever it wrote
    forged = registry.execute(ToolCall("answer", {"key": "x", "sample": {"ground_truth": "1"}}, 0), sample=row)
    assert forged.status is ToolStatus.BAD_ARGUMENTS and "'sample'" in forged.text and len(seen) == 1
    # a row is read-only for the tool
    registry = ToolRegistry([Tool(_schema("poke", {}, []), lambda sample: sample.__setitem__("x", 1))])
    assert registry.execute(ToolCall("poke", {}, 0), sample=row).status is ToolStatus.TOOL_ERROR and "x" not in row
    with pytest.raises(ToolSchemaError, match="'sample' is reserved"):
        Tool(_schema("bad", {"sample": {"type": "string"}}, []), lambda sample: "")


PARSER_FILE = '''
from hybridrl.tool_calling import ParsedTurn, ToolCall

TOOL_SCHEMAS = []
class BangParser:
    def parse(self, text):
        return ParsedTurn(text, [ToolCall("calculator", {"expression": "6*7"}, 0)] if "!" in text else [])
TOOL_PARSERS = {"bang": BangParser}
'''


def test_a_tools_file_defines_a_tool_call_parser(tmp_path, monkeypatch):
    from hybridrl.tool_calling import parsing
    from hybridrl.tool_calling.parsing import available_parsers

    # the file's parsers go into a copy of the registry: other tests in this process list the built-in ones
    monkeypatch.setattr(parsing, "_PARSERS", dict(parsing._PARSERS))
    path = tmp_path / "parsers.py"
    path.write_text(PARSER_FILE)
    build_registry(["calculator"], tools_file=path)  # only built-in tools: the file is still loaded
    assert "bang" in available_parsers()
    assert [c.arguments for c in get_parser("bang").parse("ab!").calls] == [{"expression": "6*7"}]
    assert get_parser("bang").parse("ab").calls == []
    build_registry(["calculator"], tools_file=path)  # loading the same file again replaces its own parser
    clash = tmp_path / "clash.py"
    clash.write_text(PARSER_FILE.replace('{"bang"', '{"hermes"'))
    with pytest.raises(ToolFileError, match="'hermes', which is already the parser HermesToolCallParser"):
        build_registry(["calculator"], tools_file=clash)
    bad = tmp_path / "bad_parsers.py"
    bad.write_text("TOOL_SCHEMAS = []\nTOOL_PARSERS = ['bang']\n")
    with pytest.raises(ToolFileError, match="TOOL_PARSERS must be a dict"):
        build_registry(["calculator"], tools_file=bad)


def test_a_timed_out_tool_is_killed_not_left_running(tmp_path):
    """With a time limit a call runs in a process of its own: past the limit it is killed, so what it would
    have done later never happens (a thread left running would still write the file)."""
    late = tmp_path / "late.txt"

    def slow_writer(seconds: float) -> str:
        time.sleep(seconds)
        late.write_text("still running")
        return "done"

    def failing(x: int) -> str:
        raise KeyError(f"no row {x}")

    registry = ToolRegistry([Tool(_schema("slow_writer", {"seconds": {"type": "number"}}, ["seconds"]), slow_writer,
                                  timeout_s=0.3),
                             Tool(_schema("failing", {"x": {"type": "integer"}}, ["x"]), failing, timeout_s=5)])
    timed_out = registry.execute(ToolCall("slow_writer", {"seconds": 1.0}, 0))
    assert (timed_out.status, timed_out.text) == (ToolStatus.TIMEOUT, "Error: slow_writer ran past its 0.3 s limit")
    time.sleep(1.5)
    assert not late.exists()
    quick = registry.execute(ToolCall("slow_writer", {"seconds": 0.0}, 1))
    assert (quick.status, quick.text, late.read_text()) == (ToolStatus.OK, "done", "still running")
    failed = registry.execute(ToolCall("failing", {"x": 3}, 2))
    assert (failed.status, failed.text) == (ToolStatus.TOOL_ERROR, "Error: failing raised KeyError: 'no row 3'")


def test_the_tools_file_tools_take_the_jobs_time_limit(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(GOOD)
    registry = build_registry(["python", "lookup"], tools_file=path, tool_timeout_s=7.5)
    assert [registry._tools[n].timeout_s for n in ("python", "lookup")] == [None, 7.5]
    assert build_registry(["lookup"], tools_file=path)._tools["lookup"].timeout_s is None


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def _cycle() -> list:
    value: list = []
    value.append(value)
    return value


@pytest.mark.parametrize("result, error", [
    (_cycle, "ValueError: Circular reference detected"),
    (lambda: _nested(100_000), "RecursionError: maximum recursion depth exceeded"),
])
def test_a_tool_result_that_does_not_serialize_is_a_tool_error(result, error):
    """A tools-file tool returning a cycle, or nesting deeper than json can write: json.dumps ran outside the
    call's try, so the exception left `execute` and ended the rollout. Now the tool's own error observation."""
    def echo(x: str):
        return result()

    registry = ToolRegistry([Tool(_schema("echo", {"x": {"type": "string"}}, ["x"]), echo)])
    observation = registry.execute(ToolCall("echo", {"x": "1"}, 0))
    assert observation.status is ToolStatus.TOOL_ERROR
    assert observation.text.startswith(f"Error: echo raised {error}")


def _verl_kept(text: str, limit: int, side: str) -> tuple[str, str]:
    """What verl 0.9's ToolAgentLoop._call_tool keeps of a longer tool answer (its markers left out): the text
    before and after the cut, per tool_response_truncate_side."""
    if side == "left":
        return "", text[-limit:]
    if side == "right":
        return text[:limit], ""
    length = limit // 2
    return text[:length], text[-length:]


@pytest.mark.parametrize("side", ["left", "middle", "right"])
def test_an_answer_is_cut_on_verls_side_keeping_verls_characters(side):
    """multi_turn.observation_truncate_side (verl's tool_response_truncate_side): the characters kept are verl's,
    around a note of the cut; an answer that fits is unchanged."""
    echo = Tool(_schema("echo", {"text": {"type": "string"}}, ["text"]), lambda text: text)
    registry = ToolRegistry([echo], max_observation_chars=11, truncate_side=side)
    answer = "".join(chr(ord("a") + i % 26) for i in range(40))
    [(status, text, _, _)] = _run(registry, _call("echo", text=answer))
    head, tail = _verl_kept(answer, 11, side)
    assert status is ToolStatus.OUTPUT_TRUNCATED
    note = {"left": "[output truncated: 40 characters, the last 11 shown]\n",
            "middle": "\n[output truncated: 40 characters, the first and last 5 shown]\n",
            "right": "\n[output truncated: 40 characters, the first 11 shown]"}[side]
    assert text == head + note + tail
    assert _run(registry, _call("echo", text=answer[:11]))[0][:2] == (ToolStatus.OK, answer[:11])


def test_max_parallel_calls_runs_the_first_calls_of_a_turn():
    """verl's max_parallel_calls: the first N calls the model wrote are run, the rest get no answer."""
    ran: list[int] = []
    note = Tool(_schema("note", {"i": {"type": "integer"}}, ["i"]), lambda i: ran.append(i) or str(i))
    turn = get_parser("hermes").parse("".join(_call("note", i=i) for i in range(3)))
    assert [o.text for o in ToolRegistry([note], max_parallel_calls=1).execute_turn(turn)] == ["0"]
    assert [o.text for o in ToolRegistry([note], max_parallel_calls=2).execute_turn(turn)] == ["0", "1"]
    assert [o.text for o in ToolRegistry([note]).execute_turn(turn)] == ["0", "1", "2"]
    assert ran == [0, 0, 1, 0, 1, 2]
