"""The tool-use demo's synthetic task: "the secret letter", which only a tool can tell.

Every prompt is the same user message, ``secret``; each row hides its own letter (one of
`SecretLetterTask.alphabet`, 26 by default) in its ground truth, written `min_length` times
(``"cccc"``). The prompt says nothing about it: the model can learn the letter only from the job's
``secret`` tool, which reads the calling sample's row (the tool's reserved ``sample`` parameter) and
answers with the ground truth. The call is one character, `CALL_MARK` (``?``): a model turn that writes
it is a call (the tools file `configs/examples/cpu_tiny_tool_tools.py` holds the tool and that
parser; the config makes ``?`` a stop token, so the turn ends there). With the tool demo's chat
template (`hybridrl.data.tokenizer.CHAR_TOOL_CHAT_TEMPLATE`: a tool message is its bare content and
the model's next turn follows it) a conversation that uses the tool reads::

    user: secret
    assistant: ?
    cccccccc

the model's call ``?``, the tool's ``cccc`` (an observation: not trained), the model's answer ``cccc``.

Score: the final answer only (`final_answer`: the model's last turn), its first `min_length`
characters: the share of them that are the secret letter. The call itself earns nothing; calling is
worth learning because the answer that follows can be right. Guessing a letter scores
1/len(alphabet) = 0.04 on average, copying the tool's letter 1.0.

Why this task and this model (`make demo-tools`):
- A call is discoverable by a random policy: one character among 96, and the turn stops on it; the
  untrained model calls in about a fifth of its first turns.
- The random-weight model cannot read a letter from its context and learn to call at once: copying
  is learned only from the samples that called, and the calls die out first (measured: the call rate
  fell from ~0.2 to ~0 within 15-25 steps in every variant tried,
  docs/notes/runs_that_did_not_learn.md). So the demo model gets the one skill a pretrained model
  brings before RL: `tools/make_demo_model.py --copy-warmup` trains it
  for a few hundred next-token steps on "random characters, then one letter repeated" (it learns to
  continue a letter it has just read twice, and nothing about tools, ``?`` or this task); RL then has
  to discover that calling pays.
"""
from __future__ import annotations

import random
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridrl.rewards.registry import ScoreResult, register_scorer

DATA_SOURCE = "hybridrl/secret_letter"
SCORER_NAME = "secret_letter"
PROMPT = "secret"
CALL_MARK = "?"  # a model turn that writes it calls the secret tool


@dataclass(frozen=True)
class SecretLetterTask:
    alphabet: str = string.ascii_lowercase
    min_length: int = 4  # the ground truth's length: the answer's first min_length characters are scored

    def __post_init__(self) -> None:
        if not self.alphabet or len(set(self.alphabet)) != len(self.alphabet):
            raise ValueError(f"alphabet must be non-empty with distinct characters, got {self.alphabet!r}")
        if CALL_MARK in self.alphabet:
            raise ValueError(f"alphabet {self.alphabet!r} must not hold the call mark {CALL_MARK!r}")
        if self.min_length <= 0:
            raise ValueError(f"min_length must be positive, got {self.min_length}")

    def make_row(self, rng: random.Random, index: int, split: str) -> dict[str, Any]:
        letter = rng.choice(self.alphabet)
        return {
            "prompt": [{"role": "user", "content": PROMPT}],
            "reward_model": {"style": "rule", "ground_truth": letter * self.min_length},
            "data_source": DATA_SOURCE,
            "extra_info": {"split": split, "index": index},
        }

    def make_rows(self, num_rows: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
        """`num_rows` rows in the training format; the same seed gives the same rows."""
        rng = random.Random(f"secret-{seed}-{split}")
        return [self.make_row(rng, index, split) for index in range(num_rows)]


def final_answer(response: str) -> str:
    """The model's last turn: its text after the call mark that ended the turn before (all of it when it
    never called). Each turn but the last ends at its call mark (a stop token), and the last may too
    (a call after the last allowed turn is not run): that mark is not part of the answer."""
    return response.removesuffix(CALL_MARK).rpartition(CALL_MARK)[2]


@register_scorer(SCORER_NAME, DATA_SOURCE)
def secret_letter_score(response: str, ground_truth: Any, extra: Mapping[str, Any] | None = None) -> ScoreResult:
    """See the module docstring: the share of the secret's characters the final answer starts with."""
    target = str(ground_truth)
    if not target or len(set(target)) != 1:
        raise ValueError(f"secret_letter ground truth must be one letter repeated, got {ground_truth!r}")
    answer = final_answer(response)[:len(target)]
    hits = sum(character == target[0] for character in answer)
    return ScoreResult(hits / len(target), hits == len(target), {"hits": hits, "called": CALL_MARK in response})
