"""The built-in ``calculator`` tool: an arithmetic expression evaluated by walking its syntax tree.

Only numbers (int and float literals), ``+ - * / // % **``, unary ``+ -`` and parentheses; names,
attributes, calls, subscripts, comparisons and every other syntax are refused. Sizes are bounded
before they are computed: nesting over `MAX_DEPTH` operators, an integer result over `MAX_BITS`
bits (``9 ** 9 ** 9`` is refused, not computed), an expression over `MAX_LENGTH` characters, a
non-finite float.
"""
from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

MAX_LENGTH = 1000
MAX_DEPTH = 100  # operators nested in one another; well inside the interpreter's recursion limit
MAX_BITS = 10_000  # about 3000 decimal digits, under Python's 4300-digit int-to-str limit
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}

SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses, e.g. '(3 + 4) * 12'.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "the expression to evaluate"}},
            "required": ["expression"],
        },
    },
}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says which part."""


def _bits(value: int | float) -> int:
    return abs(int(value)).bit_length() if isinstance(value, int) else 64


def _check_size(op: type, left: int | float, right: int | float) -> None:
    if not (isinstance(left, int) and isinstance(right, int)):
        return  # floats overflow to an error below, they do not grow
    if op is ast.Pow and right > 0 and abs(left) > 1 and _bits(left) * right > MAX_BITS:
        raise CalculatorError(f"{left} ** {right} is too large (over {MAX_BITS} bits)")
    if op is ast.Mult and _bits(left) + _bits(right) > MAX_BITS:
        raise CalculatorError(f"the product is too large (over {MAX_BITS} bits)")


def _evaluate(node: ast.AST, depth: int = 0) -> int | float:
    if depth > MAX_DEPTH:
        raise CalculatorError(f"the expression is nested deeper than {MAX_DEPTH} operators")
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, depth + 1)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, depth + 1), _evaluate(node.right, depth + 1)
        _check_size(type(node.op), left, right)
        if type(node.op) is ast.Pow and isinstance(left, int) and isinstance(right, int) and right < 0 \
                and abs(right) > MAX_BITS:
            raise CalculatorError(f"exponent {right} is too large")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large for a float") from None
        if isinstance(value, complex):
            raise CalculatorError("the result is not a real number")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("the result is not finite")
        return value
    kind = type(node).__name__
    what = {"Name": "names", "Attribute": "attributes", "Call": "function calls"}.get(kind, f"{kind} syntax")
    raise CalculatorError(f"{what} are not allowed; only numbers, + - * / // % ** and parentheses")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression (see the module docstring); `CalculatorError` otherwise."""
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(f"the expression is longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise CalculatorError(f"not an expression: {error.msg}") from None
    except (RecursionError, MemoryError):
        raise CalculatorError("the expression is nested too deeply") from None
    return _evaluate(tree)


def calculator(expression: str) -> str:
    """The tool's function: the value as text (Python's repr of the number)."""
    return repr(evaluate(expression))
