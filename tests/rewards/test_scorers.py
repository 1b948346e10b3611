"""Rule-based scorers on hand-made responses, including the tricky cases."""
from __future__ import annotations

from fractions import Fraction

import pytest

from hybridrl.rewards.answers import last_number, parse_number
from hybridrl.rewards.countdown import evaluate_expression, extract_expression
from hybridrl.rewards.format_check import extract_tag
from hybridrl.rewards.gsm8k import extract_hash_answer
from hybridrl.rewards.math_answer import extract_boxed, math_answers_equal, normalize_math_answer
from hybridrl.rewards.registry import UnknownScorerError, available_scorers, get_scorer

# ------------------------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("42", Fraction(42)),
        ("-7", Fraction(-7)),
        ("\u221212", Fraction(-12)),  # unicode minus
        ("1,234,567", Fraction(1234567)),
        ("$1,000.50", Fraction(2001, 2)),
        ("3.", Fraction(3)),  # sentence-final period
        ("0.5", Fraction(1, 2)),
        (".25", Fraction(1, 4)),
        ("3/4", Fraction(3, 4)),
        ("\\frac{1}{2}", Fraction(1, 2)),
        ("\\frac12", Fraction(1, 2)),
        ("-\\frac{3}{4}", Fraction(-3, 4)),
        ("\\frac{-3}{4}", Fraction(-3, 4)),
    ],
)
def test_parse_number_exact_values(text: str, value: Fraction) -> None:
    assert parse_number(text) == value


@pytest.mark.parametrize("text", ["(1,2)", "1,23", "abc", "", "1/0", "\\frac{1}{0}", "12,3456"])
def test_parse_number_rejects_non_numbers(text: str) -> None:
    assert parse_number(text) is None


def test_last_number_reads_prose() -> None:
    assert last_number("She pays $1,234.") == "1,234"
    assert last_number("the change is -7 degrees") == "-7"
    assert last_number("10-3") == "3"  # subtraction, not a negative number
    assert last_number("no digits here") is None


# --------------------------------------------------------------------------------- gsm8k
def test_gsm8k_strict_reads_the_hash_answer() -> None:
    score = get_scorer("gsm8k")
    assert score("3 + 4 = 7\n#### 7", "7", {}).score == 1.0
    assert score("#### 1,000", "1000", {}).acc is True
    assert score("#### -5", "-5", {}).score == 1.0
    assert score("#### 5", "-5", {}).score == 0.0
    # the last #### wins; numbers in the reasoning do not count in strict mode
    assert score("#### 3\nno wait\n#### 4", "4", {}).score == 1.0
    assert score("the answer is 7", "7", {}).score == 0.0
    # a full GSM8K solution as ground truth
    assert score("#### 18", "Janet sells 16 - 3 - 4 = 9 eggs... 9 * 2 = 18\n#### 18", {}).score == 1.0


def test_gsm8k_flexible_and_format_score() -> None:
    flexible = get_scorer("gsm8k", mode="flexible")
    assert flexible("so she earns $18.", "18", {}).score == 1.0
    assert flexible("total 1,200.00 dollars", "1200", {}).score == 1.0
    assert flexible("no number", "18", {}).score == 0.0
    with_format = get_scorer("gsm8k", format_score=0.1)
    assert with_format("#### 17", "18", {}).score == 0.1
    assert with_format("no answer", "18", {}).score == 0.0
    assert extract_hash_answer("#### $30.") == "30"


def test_gsm8k_alias_is_the_data_source() -> None:
    assert get_scorer("openai/gsm8k") is get_scorer("gsm8k")


# ---------------------------------------------------------------------------------- math
def test_extract_boxed_handles_nesting_and_truncation() -> None:
    assert extract_boxed("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed{1} then \\boxed{2}") == "2"
    assert extract_boxed("\\boxed 5$") == "5"
    assert extract_boxed("\\fbox{x+1}") == "x+1"
    assert extract_boxed("\\boxed{\\frac{1}{2}") is None  # cut off inside the box
    assert extract_boxed("no box") is None


@pytest.mark.parametrize(
    ("answer", "reference"),
    [
        ("\\frac{1}{2}", "0.5"),
        ("\\dfrac12", "\\frac{1}{2}"),
        ("1/2", "\\tfrac{1}{2}"),
        ("1,000", "1000"),
        ("-\\frac{3}{4}", "-0.75"),
        ("x = 5", "5"),
        ("90^\\circ", "90"),
        ("\\left(1,2\\right)", "(1, 2)"),
        ("\\text{(A)}", "(A)"),
        ("$\\sqrt{2}$", "\\sqrt{2}"),
        ("10\\%", "10"),
    ],
)
def test_math_equivalences(answer: str, reference: str) -> None:
    assert math_answers_equal(answer, reference)


@pytest.mark.parametrize(
    ("answer", "reference"),
    [("\\frac{1}{3}", "0.33"), ("-2", "2"), ("(1,2)", "(2,1)"), ("\\sqrt{2}", "\\sqrt{3}"), ("12", "1,2")],
)
def test_math_non_equivalences(answer: str, reference: str) -> None:
    assert not math_answers_equal(answer, reference)


def test_math_scorer() -> None:
    score = get_scorer("math")
    assert score("Thus \\boxed{\\frac{1}{2}}.", "0.5", {}).score == 1.0
    assert score("\\boxed{0.5}", "The answer is $\\boxed{\\dfrac12}$", {}).acc is True
    assert score("\\boxed{3}", "4", {}).score == 0.0
    assert score("the answer is 4", "4", {}).score == 0.0  # no box: no answer
    assert get_scorer("math", format_score=0.2)("\\boxed{3}", "4", {}).score == 0.2
    assert normalize_math_answer("\\frac{1}2") == "\\frac{1}{2}"


def test_math_scorer_unboxed_last_number() -> None:
    score = get_scorer("math", unboxed="last_number")
    assert score("7 + 5 = 12", "12", {}).score == 1.0  # no box: the last number is the answer
    assert score("12 apples, then 3 more", "12", {}).score == 0.0
    assert score("\\boxed{12} then 3", "12", {}).acc is True  # a box still decides
    # format_score is for a wrong boxed answer only: a wrong bare number did not use the format
    partial = get_scorer("math", unboxed="last_number", format_score=0.2)
    assert partial("\\boxed{3}", "4", {}).score == 0.2 and partial("3", "4", {}).score == 0.0
    with pytest.raises(ValueError, match=r"unboxed='first' is not one of \('none', 'last_number'\)"):
        score("1", "1", {}, unboxed="first")


# -------------------------------------------------------------------------------- format
def test_format_check_default_tags() -> None:
    score = get_scorer("format")
    assert score("<think>a</think><answer>b</answer>", None, {}).score == 1.0
    assert score("  <think>\nmulti\nline\n</think>\n<answer>42</answer>\n", None, {}).score == 1.0
    assert score("<answer>b</answer><think>a</think>", None, {}).score == 0.0  # order
    assert score("<think>a</think>", None, {}).score == 0.0  # missing block
    assert score("x <think>a</think><answer>b</answer>", None, {}).score == 0.0  # text outside
    assert score("<think>a</think><think>b</think><answer>c</answer>", None, {}).score == 0.0  # twice
    assert score("<think>a</think><answer>b</answer><answer>c</answer>", None, {}).score == 0.0


def test_format_check_configurable_tags() -> None:
    score = get_scorer("format", tags=("reasoning", "final-answer"))
    assert score("<reasoning>r</reasoning> <final-answer>1</final-answer>", None, {}).score == 1.0
    assert score("<think>a</think><answer>b</answer>", None, {}).score == 0.0
    with pytest.raises(ValueError, match="invalid tag name"):
        get_scorer("format", tags=("a b",))("x", None, {})
    assert extract_tag("<answer> 7 </answer>", "answer") == "7"


# ----------------------------------------------------------------------------- countdown
COUNTDOWN = {"target": 24, "numbers": [4, 7, 8, 8]}


def test_countdown_correct_expressions() -> None:
    score = get_scorer("countdown")
    assert score("<think>try</think><answer>(8 - 4) * 7 - 8 + 4</answer>", COUNTDOWN, {}).score == 0.0  # 4 twice
    assert score("<answer>(7 - 4) * 8</answer>", COUNTDOWN, {}).score == 1.0
    assert score("<answer>8 * (7 - 4) = 24</answer>", COUNTDOWN, {}).score == 1.0
    assert score("I think\n(7-4)*8", COUNTDOWN, {}).acc is True  # last line without tags
    # exact fractions: 8 / (1 - 2/3) = 24 with no float error
    assert score("<answer>8 / (1 - 2 / 3)</answer>", {"target": 24, "numbers": [8, 1, 2, 3]}, {}).score == 1.0


def test_countdown_failures() -> None:
    score = get_scorer("countdown", format_score=0.1)
    division_by_zero = score("<answer>8 / (4 - 4)</answer>", {"target": 2, "numbers": [8, 4, 4]}, {})
    assert division_by_zero.score == 0.0 and "division by zero" in division_by_zero.details["reason"]
    twice = score("<answer>8 * 8 - 7 * 4 - 8 - 4</answer>", COUNTDOWN, {})  # 8 three times, 4 twice
    assert twice.score == 0.1 and "more often" in twice.details["reason"]
    not_given = score("<answer>6 * 4</answer>", COUNTDOWN, {})
    assert not_given.score == 0.1
    wrong_value = score("<answer>8 + 8</answer>", COUNTDOWN, {})
    assert wrong_value.score == 0.1 and "not 24" in wrong_value.details["reason"]
    assert score("<answer></answer>", COUNTDOWN, {}).score == 0.0
    assert score("", COUNTDOWN, {}).score == 0.0
    assert get_scorer("countdown", use_all=True)("<answer>(7 - 4) * 8</answer>", COUNTDOWN, {}).score == 0.0


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",
        "2 ** 10",
        "-4 + 28",  # unary minus is not one of the allowed operators
        "4.0 * 6",
        "True + 23",
        "[8][0] * 3",
        "(lambda: 24)()",
        "8 // 3",
        "1" * 300,
    ],
)
def test_countdown_refuses_anything_but_arithmetic(expression: str) -> None:
    result = get_scorer("countdown")(f"<answer>{expression}</answer>", {"target": 24, "numbers": [4, 6, 8, 28]}, {})
    assert result.score == 0.0
    assert result.acc is False


def test_countdown_evaluator_returns_used_numbers() -> None:
    value, used = evaluate_expression("(8 - 4) * (7 - 1)")
    assert value == 24 and used == [8, 4, 7, 1]
    assert extract_expression("<answer> 1 + 2 = 3 </answer>") == "1 + 2"


def test_countdown_bad_ground_truth_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="'target' and 'numbers'"):
        get_scorer("countdown")("1+1", 2, {})


# ------------------------------------------------------------------------------ registry
def test_registry_lists_builtins() -> None:
    names = available_scorers()
    for expected in ("gsm8k", "math", "format", "countdown", "repeat_letter"):
        assert expected in names


def test_unknown_scorer_suggests_a_name() -> None:
    with pytest.raises(UnknownScorerError) as error:
        get_scorer("gsm8kk")
    message = str(error.value)
    assert "Did you mean 'gsm8k'?" in message
    assert "countdown" in message and "math" in message


def test_unknown_scorer_option_is_refused_at_lookup() -> None:
    with pytest.raises(TypeError, match="no option"):
        get_scorer("gsm8k", modee="flexible")
