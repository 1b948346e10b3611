"""Countdown: combine the given numbers with + - * / and parentheses to reach the target.

The ground truth is ``{"target": 24, "numbers": [4, 7, 8, 8]}``. The expression is taken from the
last ``<answer>...</answer>`` block if there is one, else from the last line of the response; a
trailing ``= 24`` is dropped. It is parsed with `ast` and only integer literals, the four binary
operators and parentheses are accepted: nothing is ever passed to ``eval``, so a response cannot run
code, and a huge or deeply nested expression is refused by its length before parsing. Values are
exact fractions (``(8/3)*3`` is 8, not 7.999...). Each given number may be used at most once
(``use_all=True``: exactly once); using a number not given, or one more often than given, fails.

Score: 1.0 right; ``format_score`` for a well-formed expression with a wrong value or wrong numbers;
0.0 for no expression, a syntax error, a forbidden construct or a division by zero.
"""
from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from hybridrl.rewards.format_check import extract_tag
from hybridrl.rewards.registry import ScoreResult, register_scorer

MAX_EXPRESSION_CHARS = 200
_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,  # Fraction division; zero is checked before
}


class ExpressionError(ValueError):
    """The expression is not a plain arithmetic expression over integers."""


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant):
        # bool is an int subclass: "True" is not a number the puzzle gave.
        if type(node.value) is not int:
            raise ExpressionError(f"only whole numbers may appear, found {node.value!r}")
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left = _evaluate(node.left, used)
        right = _evaluate(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ZeroDivisionError("division by zero")
        return _OPERATORS[type(node.op)](left, right)
    raise ExpressionError(f"{type(node).__name__} is not allowed; use numbers, + - * / and parentheses")


def evaluate_expression(expression: str) -> tuple[Fraction, list[int]]:
    """(exact value, the integer literals used in order). Raises ExpressionError / ZeroDivisionError."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    expression = expression.replace("\u00d7", "*").replace("\u00f7", "/").replace("\u2212", "-")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ExpressionError(f"not an arithmetic expression: {error.msg}") from error
    used: list[int] = []
    return _evaluate(tree, used), used


def extract_expression(response: str) -> str | None:
    """The expression in the response: the last <answer> block, else the last non-empty line."""
    text = extract_tag(response, "answer")
    if text is None:
        lines = [line.strip() for line in response.strip().splitlines() if line.strip()]
        text = lines[-1] if lines else None
    if not text:
        return None
    if "=" in text:  # "3 * 8 = 24": the left side is the expression
        text = text.split("=", 1)[0]
    return text.strip() or None


def _parse_ground_truth(ground_truth: Any) -> tuple[Fraction, list[int]]:
    if not isinstance(ground_truth, Mapping) or "target" not in ground_truth or "numbers" not in ground_truth:
        raise ValueError(
            f"countdown ground truth must be a dict with 'target' and 'numbers', got {ground_truth!r}"
        )
    numbers = [int(n) for n in ground_truth["numbers"]]
    return Fraction(ground_truth["target"]), numbers


@register_scorer("countdown", "countdown_arithmetic")
def countdown_score(
    response: str,
    ground_truth: Any,
    extra: Mapping[str, Any] | None = None,
    *,
    format_score: float = 0.0,
    use_all: bool = False,
) -> ScoreResult:
    target, numbers = _parse_ground_truth(ground_truth)
    expression = extract_expression(response)
    if expression is None:
        return ScoreResult(0.0, False, {"reason": "no expression"})
    try:
        value, used = evaluate_expression(expression)
    except (ExpressionError, ZeroDivisionError) as error:
        return ScoreResult(0.0, False, {"expression": expression, "reason": str(error)})
    available, wanted = Counter(numbers), Counter(used)
    overused = {n: c for n, c in wanted.items() if c > available.get(n, 0)}
    details: dict[str, Any] = {"expression": expression, "value": value}
    if overused:
        details["reason"] = f"numbers used more often than given: {overused}"
        return ScoreResult(format_score, False, details)
    if use_all and wanted != available:
        details["reason"] = f"must use every number exactly once; unused: {dict(available - wanted)}"
        return ScoreResult(format_score, False, details)
    if value != target:
        details["reason"] = f"evaluates to {value}, not {target}"
        return ScoreResult(format_score, False, details)
    return ScoreResult(1.0, True, details)
