"""The arithmetic word problems of `make demo-real`: the generator, its answers, its scorer, its tool."""
from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.data.arith_task import (
    ADDS,
    DATA_SOURCE,
    INSTRUCTION,
    SCORER_NAME,
    TAKES,
    ArithProblem,
    ArithWordTask,
    arith_word_score,
)
from hybridrl.data.dataset import read_rows
from hybridrl.rewards.registry import get_scorer

REPO = Path(__file__).resolve().parents[2]

# The verbs of the phrases, read back from the prompt text by a parser written here (not the generator's).
_ADD_WORDS = ("buys", "finds", "gets", "wins")
_TAKE_WORDS = ("gives", "loses", "sells")


def _solve_from_text(text: str) -> int:
    """The answer computed from the prompt's words alone: an independent reading of the problem."""
    start = int(re.search(r" has (\d+) ", text).group(1))
    story = text.split(". ", 1)[1].split(". How many")[0]
    total = start
    for verb, number in re.findall(r"\b(buys|finds|gets|wins|gives|loses|sells) (\d+)", story):
        total += int(number) if verb in _ADD_WORDS else -int(number)
    return total


def test_the_same_seed_and_split_give_the_same_rows() -> None:
    task = ArithWordTask()
    rows = task.make_rows(100, seed=3)
    assert rows == task.make_rows(100, seed=3)
    assert rows != task.make_rows(100, seed=4)
    assert rows != task.make_rows(100, seed=3, split="val")
    # a fresh process draws the same rows: string seeds, no hash randomization in play
    code = ("from hybridrl.data.arith_task import ArithWordTask; import json; "
            "print(json.dumps(ArithWordTask().make_rows(5, seed=3)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"})
    import json

    assert json.loads(out.stdout) == rows[:5]


def test_hand_computed_problems() -> None:
    problem = ArithProblem("Tom", "He", "apples", 7, ((ADDS[0], 5), (TAKES[3], -3)))
    assert problem.answer == 9  # 7 + 5 - 3
    assert problem.text() == ("Tom has 7 apples. He buys 5 more, then gives 3 away. "
                              f"How many apples does Tom have now? {INSTRUCTION}")
    three = ArithProblem("Anna", "She", "cards", 4, ((TAKES[1], -4), (ADDS[1], 6), (TAKES[2], -2)))
    assert three.answer == 4  # 4 - 4 + 6 - 2
    assert three.text().startswith("Anna has 4 cards. She loses 4, then finds 6 more, and then sells 2. ")


def test_every_generated_answer_matches_an_independent_reading_of_the_prompt() -> None:
    task = ArithWordTask(steps=(1, 4), max_start=30, max_change=12)
    rows = task.make_rows(500, seed=0)
    steps_seen = set()
    for row in rows:
        (message,) = row["prompt"]
        assert message["role"] == "user" and message["content"].endswith(INSTRUCTION)
        answer = int(row["reward_model"]["ground_truth"])
        assert answer == _solve_from_text(message["content"]), message["content"]
        assert answer >= 0
        assert row["data_source"] == DATA_SOURCE
        steps_seen.add(row["extra_info"]["steps"])
    assert steps_seen == {1, 2, 3, 4}
    # counts never go below zero along the way either (a take is at most the count at that point)
    rng = random.Random(1)
    for _ in range(500):
        problem = task.make_problem(rng)
        count = problem.start
        for _, amount in problem.changes:
            count += amount
            assert count >= 0, problem


def test_bad_settings_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match=r"steps must satisfy 1 <= low <= high, got \(3, 2\)"):
        ArithWordTask(steps=(3, 2))
    with pytest.raises(ValueError, match="max_start must be >= 2, got 1"):
        ArithWordTask(max_start=1)
    with pytest.raises(ValueError, match="max_change must be >= 1, got 0"):
        ArithWordTask(max_change=0)


# Responses of the kind SmolLM2-135M-Instruct writes on these prompts (seen with tools/probe_arith_task.py).
@pytest.mark.parametrize(("response", "truth", "score"), [
    ("9", "9", 1.0),
    ("Tom has 7 + 5 - 3 = 9 apples.", "9", 1.0),
    ("He sells 4 books, so he has 5 - 4 = 1 book left.\nHe gets 7 more, so he has 1 + 7 = 8", "8", 1.0),
    ("Ben has now 4 more apples.\n#### 4\nThe answer is 4.", "13", 0.0),
    ("Anna has 9 + 4 + 5 + 1 = 21 marbles.", "17", 0.0),
    ("The answer is \\boxed{12}, not 13", "12", 1.0),  # a box wins over the last number
    ("\\boxed{13} ... 12", "12", 0.0),
    ("I cannot tell.", "3", 0.0),
    ("", "3", 0.0),
    ("She has 1,000 coins.", "1000", 1.0),
    ("She has 12.0 coins.", "12", 1.0),
])
def test_scorer_on_responses_of_this_task(response: str, truth: str, score: float) -> None:
    result = arith_word_score(response, truth)
    assert result.score == score
    assert result.acc is (score == 1.0)
    assert get_scorer(SCORER_NAME) is get_scorer(DATA_SOURCE) is arith_word_score
    # the registered math scorer with the same option gives the same result: one scorer, reused
    assert get_scorer("math", unboxed="last_number")(response, truth, {}).score == score


def test_make_arith_data_tool_writes_the_generator_rows(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "tools/make_arith_data.py", "--out-dir", str(tmp_path),
                             "--train-rows", "40", "--val-rows", "8", "--seed", "5", "--steps", "2", "3"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert read_rows(tmp_path / "train.jsonl") == ArithWordTask(steps=(2, 3)).make_rows(40, seed=5)
    assert read_rows(tmp_path / "val.jsonl") == ArithWordTask(steps=(2, 3)).make_rows(8, seed=5, split="val")
    bad = subprocess.run([sys.executable, "tools/make_arith_data.py", "--out-dir", str(tmp_path / "x"),
                          "--steps", "0", "2"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "steps must satisfy 1 <= low <= high, got (0, 2)" in bad.stderr
    assert not (tmp_path / "x").exists()
