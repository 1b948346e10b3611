"""Math answers in ``\\boxed{...}``: extraction with brace matching and a light LaTeX normalization.

Two answers are equal when their normalized strings are equal, or when both are numbers of the same
exact value (``\\frac{1}{2}`` = ``0.5`` = ``1/2``; ``1,000`` = ``1000``). The normalization is
deliberately small (no symbolic algebra): it removes ``$``, ``\\left``/``\\right``, spacing commands,
``\\text{}`` wrappers, degree marks, a leading ``x =``, turns ``\\dfrac``/``\\tfrac`` into ``\\frac``
and adds the braces LaTeX lets one omit (``\\frac12``).

Score: 1.0 right; ``format_score`` when a boxed answer was found but is wrong; 0.0 when none was.
With ``unboxed="last_number"`` a response without a box is judged by the last number it writes (for
small models that answer "7 + 5 = 12" and never learned the box); the default ``"none"`` scores it 0.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from hybridrl.rewards.answers import last_number, numbers_equal
from hybridrl.rewards.registry import ScoreResult, register_scorer

_BOX_COMMANDS = ("\\boxed", "\\fbox")
UNBOXED_MODES = ("none", "last_number")


def _braced_content(text: str, open_index: int) -> str | None:
    """The text inside the brace group that opens at `open_index` (nested braces allowed)."""
    depth = 0
    for i in range(open_index, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1:i]
    return None  # unbalanced: the response was cut off inside the box


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in `text`."""
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest_index = start + len(command)
    rest = text[rest_index:]
    if rest.startswith("{"):
        return _braced_content(text, rest_index)
    if rest.startswith(" "):  # "\boxed 5": the argument runs to the next space or dollar sign
        return re.split(r"[\s$]", rest.lstrip(" "), maxsplit=1)[0] or None
    return None


def _remove_text_wrappers(answer: str) -> str:
    # \text{ cm} / \textbf{5} / \mbox{...}: keep the content. Repeated for nesting.
    previous = None
    while previous != answer:
        previous = answer
        answer = re.sub(r"\\(?:text|textbf|textrm|mathrm|mbox)\{([^{}]*)\}", r"\1", answer)
    return answer


def normalize_math_answer(answer: str) -> str:
    """A canonical string for `answer` (see the module docstring for what is normalized)."""
    answer = answer.strip()
    answer = answer.replace("\n", "").strip("$").strip()
    answer = _remove_text_wrappers(answer)
    for command in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\displaystyle"):
        answer = answer.replace(command, "")
    answer = answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    answer = re.sub(r"\^\{?\\circ\}?", "", answer)  # degrees
    answer = answer.replace("\\%", "").replace("%", "")
    answer = answer.replace(" ", "")
    # A single variable assignment: "x=5" -> "5" (not "x=5,y=3", which is a list of assignments).
    if answer.count("=") == 1 and re.match(r"^[a-zA-Z]\w*=", answer):
        answer = answer.split("=", 1)[1]
    # \frac12 -> \frac{1}{2}; \frac1{2} -> \frac{1}{2}; \frac{1}2 -> \frac{1}{2}
    answer = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", answer)
    answer = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", answer)
    answer = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", answer)
    answer = answer.rstrip(".")
    # Fractions that are whole numbers written as "\frac{6}{3}" stay strings here; numbers_equal
    # compares their values.
    return answer


def math_answers_equal(answer: str, reference: str) -> bool:
    normalized_answer, normalized_reference = normalize_math_answer(answer), normalize_math_answer(reference)
    if normalized_answer == normalized_reference:
        return True
    return numbers_equal(normalized_answer, normalized_reference)


def reference_answer(ground_truth: Any) -> str:
    """The reference: a bare answer, or a solution whose last ``\\boxed{}`` holds it."""
    text = str(ground_truth)
    boxed = extract_boxed(text)
    return boxed if boxed is not None else text


@register_scorer("math", "math_boxed", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval")
def math_score(
    response: str,
    ground_truth: Any,
    extra: Mapping[str, Any] | None = None,
    *,
    format_score: float = 0.0,
    unboxed: str = "none",
) -> ScoreResult:
    if unboxed not in UNBOXED_MODES:
        raise ValueError(f"math scorer option unboxed={unboxed!r} is not one of {UNBOXED_MODES}")
    answer = extract_boxed(response)
    boxed = answer is not None
    if answer is None and unboxed == "last_number":
        answer = last_number(response)
    reference = reference_answer(ground_truth)
    if answer is None:
        return ScoreResult(0.0, False, {"answer": None, "reference": reference, "boxed": False})
    correct = math_answers_equal(answer, reference)
    # format_score rewards the format the scorer asks for: a box, not any number in the text.
    score = 1.0 if correct else (format_score if boxed else 0.0)
    return ScoreResult(score, correct, {"answer": answer, "reference": reference, "boxed": boxed})
