"""The tool-use demo's task (hybridrl/data/secret_task.py) and its tools file
(configs/examples/cpu_tiny_tool_tools.py), against hand-written cases."""
from pathlib import Path

import pytest

from hybridrl.data.secret_task import CALL_MARK, SecretLetterTask, final_answer, secret_letter_score
from hybridrl.data.tokenizer import CHAR_TOOL_CHAT_TEMPLATE, char_tokenizer
from hybridrl.rewards.registry import get_scorer
from hybridrl.tool_calling import ToolStatus, build_registry, get_parser

ROOT = Path(__file__).resolve().parents[2]
TOOLS_FILE = ROOT / "configs/examples/cpu_tiny_tool_tools.py"


def test_rows_hide_the_letter_from_the_prompt_and_repeat_with_the_seed():
    task = SecretLetterTask()
    rows = task.make_rows(200, seed=3)
    assert rows == task.make_rows(200, seed=3) and rows != task.make_rows(200, seed=4)
    assert all(r["prompt"] == [{"role": "user", "content": "secret"}] for r in rows)  # says nothing
    letters = {r["reward_model"]["ground_truth"] for r in rows}
    assert all(len(t) == 4 and len(set(t)) == 1 and t[0] in "abcdefghijklmnopqrstuvwxyz" for t in letters)
    assert len(letters) > 20  # 26 letters, drawn at random
    with pytest.raises(ValueError, match="call mark"):
        SecretLetterTask(alphabet="ab?")


@pytest.mark.parametrize("response,answer,score", [
    ("cccc", "cccc", 1.0),                # no call: the whole text is the answer
    ("abc", "abc", 0.25),
    ("xyz?cccc", "cccc", 1.0),            # the last turn, after the call
    ("xyz?cc", "cc", 0.5),                # shorter than 4: the missing characters count as wrong
    ("?ccxcccc", "ccxcccc", 0.75),        # only the first 4 characters are read
    ("?cccc?", "cccc", 1.0),              # a last turn that called again: its mark is not the answer
    ("?", "", 0.0),                       # called, then nothing
    ("ab??", "", 0.0),
])
def test_the_score_reads_the_first_four_characters_of_the_last_turn(response, answer, score):
    assert final_answer(response) == answer
    assert secret_letter_score(response, "cccc").score == score
    assert get_scorer("secret_letter")(response, "cccc", {}).score == score
    assert get_scorer("hybridrl/secret_letter")(response, "cccc", {}).score == score  # the rows' data source


def test_the_tools_file_answers_from_the_calling_samples_row_through_its_own_parser(monkeypatch):
    from hybridrl.tool_calling import parsing

    monkeypatch.setattr(parsing, "_PARSERS", dict(parsing._PARSERS))  # the file's parser: this test's only
    registry = build_registry(["secret"], tools_file=TOOLS_FILE)
    parser = get_parser("call_mark")  # registered by the tools file
    assert not parser.parse("abc").has_tool_calls
    turn = parser.parse(f"xy{CALL_MARK}")
    assert [c.name for c in turn.calls] == ["secret"] and turn.content == "xy"
    [observation] = registry.execute_turn(turn, {"ground_truth": "kkkk", "index": 7})
    assert (observation.status, observation.text) == (ToolStatus.OK, "kkkk")
    assert registry.schemas()[0]["function"]["parameters"] == {"type": "object", "properties": {}}


def test_the_tool_template_puts_the_tools_answer_right_before_the_models_next_turn():
    tok = char_tokenizer(CHAR_TOOL_CHAT_TEMPLATE)
    messages = [{"role": "user", "content": "secret"}, {"role": "assistant", "content": "?"},
                {"role": "tool", "name": "secret", "content": "cccc"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        "user: secret\nassistant: ?\ncccc"
    assert tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True) == \
        "user: secret\nassistant: "
