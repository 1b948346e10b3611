"""Answer extraction and normalization shared by the math-style scorers.

Numbers are compared as exact `fractions.Fraction` values, so ``0.5``, ``1/2`` and ``\\frac{1}{2}``
are the same answer and no float rounding can make ``0.1 + 0.2`` style answers differ.
"""
from __future__ import annotations

import re
from fractions import Fraction

# Thousands separators only in well-formed groups: "1,234,567" is a number, "(1,2)" is a pair.
_INTEGER_WITH_COMMAS = re.compile(r"^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$")
_PLAIN_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
_SLASH_FRACTION = re.compile(r"^([+-]?\d+)\s*/\s*([+-]?\d+)$")
# \frac{a}{b}, \frac ab, \frac{a}b, \frac a{b}: single digits may drop the braces in LaTeX.
_LATEX_FRACTION = re.compile(r"^([+-]?)\\frac(?:\{([^{}]+)\}|(\d))(?:\{([^{}]+)\}|(\d))$")
# Numbers as they appear in prose: "-1,234.5", "42", ".5"; used to find the last number in a text.
# A minus sign right after a word or digit is subtraction ("5-3" ends in the number 3, not -3).
NUMBER_IN_TEXT = re.compile(r"(?:(?<![\w)])-)?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")

_UNICODE_MINUS = {"\u2212": "-", "\u2013": "-", "\u2014": "-"}


def _clean_number_text(text: str) -> str:
    for dash, ascii_minus in _UNICODE_MINUS.items():
        text = text.replace(dash, ascii_minus)
    text = text.strip().strip("$").strip()
    text = text.rstrip(".")  # sentence-final period: "is 42."
    return text.replace(" ", "")


def parse_number(text: str) -> Fraction | None:
    """The exact value of a number written as an integer, decimal, ``a/b`` or ``\\frac{a}{b}``; else None."""
    text = _clean_number_text(text)
    if not text:
        return None
    if _INTEGER_WITH_COMMAS.match(text):
        text = text.replace(",", "")
    if _PLAIN_NUMBER.match(text):
        try:
            return Fraction(text)
        except (ValueError, ZeroDivisionError):
            return None
    match = _SLASH_FRACTION.match(text)
    if match:
        numerator, denominator = int(match.group(1)), int(match.group(2))
        return Fraction(numerator, denominator) if denominator else None
    match = _LATEX_FRACTION.match(text)
    if match:
        sign, num_braced, num_digit, den_braced, den_digit = match.groups()
        numerator = parse_number(num_braced if num_braced is not None else num_digit)
        denominator = parse_number(den_braced if den_braced is not None else den_digit)
        if numerator is None or denominator is None or denominator == 0:
            return None
        value = numerator / denominator
        return -value if sign == "-" else value
    return None


def last_number(text: str) -> str | None:
    """The last number written in `text` ("... so she pays $1,234." -> "1,234"), or None."""
    for dash, ascii_minus in _UNICODE_MINUS.items():
        text = text.replace(dash, ascii_minus)
    matches = NUMBER_IN_TEXT.findall(text)
    return matches[-1] if matches else None


def numbers_equal(a: str, b: str) -> bool:
    """Both parse as numbers and have the same exact value."""
    value_a, value_b = parse_number(a), parse_number(b)
    return value_a is not None and value_b is not None and value_a == value_b
