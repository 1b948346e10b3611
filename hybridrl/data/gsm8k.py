"""GSM8K-style rows (``question``, ``answer`` ending in ``#### N``) in the training format.

Output row::

    {"prompt": [{"role": "user", "content": question + instruction}],
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "data_source": "openai/gsm8k",
     "extra_info": {"split": ..., "index": ..., "question": ..., "answer": ...}}

The ground truth is the number after ``####`` with thousands separators removed, so the ``gsm8k``
scorer (registered under the data source name too) can compare it with a response's answer.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridrl.rewards.gsm8k import extract_hash_answer

DATA_SOURCE = "openai/gsm8k"
DEFAULT_INSTRUCTION = "Solve it step by step, then write the final answer on the last line as '#### <number>'."


class Gsm8kFormatError(ValueError):
    """A source row that is not a GSM8K question/answer pair; the message names the row."""


@dataclass
class ConversionReport:
    converted: int = 0
    skipped: list[str] = field(default_factory=list)  # "row 3: no '####' answer"


def convert_row(
    row: Mapping[str, Any], index: int, split: str, instruction: str = DEFAULT_INSTRUCTION
) -> dict[str, Any]:
    question, answer = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not question.strip():
        raise Gsm8kFormatError(f"row {index}: no 'question' text")
    if not isinstance(answer, str):
        raise Gsm8kFormatError(f"row {index}: no 'answer' text")
    final = extract_hash_answer(answer)
    if final is None:
        raise Gsm8kFormatError(f"row {index}: the answer has no '#### <number>' line")
    content = f"{question.strip()} {instruction}".strip()
    return {
        "prompt": [{"role": "user", "content": content}],
        "reward_model": {"style": "rule", "ground_truth": final.replace(",", "")},
        "data_source": DATA_SOURCE,
        "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
    }


def convert_rows(
    rows: Sequence[Mapping[str, Any]], split: str, instruction: str = DEFAULT_INSTRUCTION, skip_bad: bool = False
) -> tuple[list[dict[str, Any]], ConversionReport]:
    """Convert all rows; a bad row raises (naming it) unless `skip_bad`, which counts it instead."""
    report = ConversionReport()
    converted = []
    for index, row in enumerate(rows):
        try:
            converted.append(convert_row(row, index, split, instruction))
        except Gsm8kFormatError as error:
            if not skip_bad:
                raise
            report.skipped.append(str(error))
    report.converted = len(converted)
    return converted, report
