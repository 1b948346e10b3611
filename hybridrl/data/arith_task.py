"""The real model's task: multi-step arithmetic word problems, written by a seeded generator.

Prompt (one user message; the model's chat template is applied by `PromptDataset`)::

    Tom has 7 apples. He buys 5 more, then gives 3 to a friend. How many apples does Tom have now?
    Answer with just the number.

Each problem starts from a count and applies `steps` changes (adds and takes, never below zero).
The ground truth is the final count as a decimal string ("9").

Score: `hybridrl.rewards.math_answer.math_score` with ``unboxed="last_number"`` (registered here as
``arith_word`` and under the rows' data source): a ``\\boxed{}`` answer when the response has one,
else the last number it writes, compared by exact value. 1.0 right, 0.0 otherwise.

Why this task: SmolLM2-135M-Instruct can add two small numbers ("7 + 5 = 12") but loses track over
two or three changes, so its untrained score sits in the middle of the range and GRPO has both right
and wrong samples in most groups to learn from. The difficulty (number of steps, the sizes of the
numbers) is set so the untrained model scores between ~0.1 and ~0.6 (figures in docs/demos.md).
"""
from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridrl.rewards.math_answer import math_score
from hybridrl.rewards.registry import ScoreResult, register_scorer

DATA_SOURCE = "hybridrl/arith_word"
SCORER_NAME = "arith_word"
INSTRUCTION = "Answer with just the number."

NAMES: tuple[tuple[str, str], ...] = (  # (name, subject pronoun)
    ("Tom", "He"), ("Anna", "She"), ("Sam", "He"), ("Lily", "She"), ("Ben", "He"), ("Mia", "She"),
    ("Jack", "He"), ("Emma", "She"), ("Leo", "He"), ("Zoe", "She"),
)
ITEMS: tuple[str, ...] = ("apples", "marbles", "stickers", "pencils", "cookies", "cards", "books", "coins")
# A change of the count: its phrase (with {k}) and its sign.
ADDS: tuple[str, ...] = ("buys {k} more", "finds {k} more", "gets {k} more from a friend", "wins {k} more")
TAKES: tuple[str, ...] = ("gives {k} to a friend", "loses {k}", "sells {k}", "gives {k} away")


@dataclass(frozen=True)
class ArithProblem:
    name: str
    pronoun: str
    item: str
    start: int
    changes: tuple[tuple[str, int], ...]  # (phrase template, signed amount)

    @property
    def answer(self) -> int:
        return self.start + sum(amount for _, amount in self.changes)

    def text(self, instruction: str = INSTRUCTION) -> str:
        phrases = [template.format(k=abs(amount)) for template, amount in self.changes]
        # "buys 5 more" / "buys 5 more, then loses 3" / "buys 5 more, then loses 3, and then ..."
        story = ", then ".join(phrases[:2])
        if len(phrases) > 2:
            story += "".join(f", and then {phrase}" for phrase in phrases[2:])
        question = (f"{self.name} has {self.start} {self.item}. {self.pronoun} {story}. "
                    f"How many {self.item} does {self.name} have now?")
        return f"{question} {instruction}".strip()


@dataclass(frozen=True)
class ArithWordTask:
    # Defaults measured on SmolLM2-135M-Instruct (tools/probe_arith_task.py): one change of at most 5
    # from a start of at most 10 scores 0.21 sampled at temperature 0.7 (32 prompts, n=4, 48 tokens)
    # and 0.28 greedy, 0.39 greedy on the 64 validation problems at 32 tokens; two changes scored 0.06
    # sampled and 0.17 greedy (64 prompts, 40 tokens), too few right samples for GRPO to learn from in
    # a short run; (2, 3) changes, starts up to 20 and changes up to 9: 0.016 sampled, 0.125 greedy.
    steps: tuple[int, int] = (1, 1)  # changes per problem (inclusive range)
    max_start: int = 10  # the starting count is drawn from [2, max_start]
    max_change: int = 5  # each change moves the count by 1..max_change
    instruction: str = INSTRUCTION

    def __post_init__(self) -> None:
        low, high = self.steps
        if not 1 <= low <= high:
            raise ValueError(f"steps must satisfy 1 <= low <= high, got {self.steps}")
        if self.max_start < 2:
            raise ValueError(f"max_start must be >= 2, got {self.max_start}")
        if self.max_change < 1:
            raise ValueError(f"max_change must be >= 1, got {self.max_change}")

    def make_problem(self, rng: random.Random) -> ArithProblem:
        name, pronoun = rng.choice(NAMES)
        item = rng.choice(ITEMS)
        start = rng.randint(2, self.max_start)
        count = start
        changes: list[tuple[str, int]] = []
        for _ in range(rng.randint(*self.steps)):
            amount = rng.randint(1, self.max_change)
            # A take that would go below zero becomes an add: a count is never negative.
            if rng.random() < 0.5 and amount <= count:
                changes.append((rng.choice(TAKES), -amount))
                count -= amount
            else:
                changes.append((rng.choice(ADDS), amount))
                count += amount
        return ArithProblem(name, pronoun, item, start, tuple(changes))

    def make_row(self, rng: random.Random, index: int, split: str) -> dict[str, Any]:
        problem = self.make_problem(rng)
        return {
            "prompt": [{"role": "user", "content": problem.text(self.instruction)}],
            "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
            "data_source": DATA_SOURCE,
            "extra_info": {"split": split, "index": index, "steps": len(problem.changes)},
        }

    def make_rows(self, num_rows: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
        """`num_rows` rows in the training format; the same seed and split give the same rows."""
        # The split is mixed into the seed so train and val drawn with one seed still differ.
        rng = random.Random(f"arith-{seed}-{split}")
        return [self.make_row(rng, index, split) for index in range(num_rows)]


@register_scorer(SCORER_NAME, DATA_SOURCE)
def arith_word_score(response: str, ground_truth: Any, extra: Mapping[str, Any] | None = None) -> ScoreResult:
    """The math answer scorer, falling back to the last number when the response has no box."""
    return math_score(response, ground_truth, extra, unboxed="last_number")
