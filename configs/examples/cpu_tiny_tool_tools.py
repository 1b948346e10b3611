"""The tools file of `configs/examples/cpu_tiny_tool_grpo.yaml`: the secret-letter task's tool and parser.

Trusted code, imported by the trainer and every actor worker (`hybridrl/tool_calling/user_tools.py`).

- ``secret``: answers the calling sample's hidden letter. Its ``sample`` parameter (not in the schema:
  the model cannot set it) receives that sample's data row, whose ``ground_truth`` is the answer
  (`hybridrl/data/secret_task.py`).
- ``TOOL_PARSERS["call_mark"]``: the tiny random model cannot write ``<tool_call>{json}</tool_call>``,
  so its call is one character: a turn that writes ``?`` (`CALL_MARK`) calls ``secret``, once however
  many marks it holds. The config makes ``?`` a stop token, so the turn ends at the mark.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridrl.data.secret_task import CALL_MARK
from hybridrl.tool_calling.parsing import ParsedTurn, ToolCall

TOOL_SCHEMAS = [{
    "type": "function",
    "function": {
        "name": "secret",
        "description": "The hidden letter of this problem, written four times.",
        "parameters": {"type": "object", "properties": {}},
    },
}]


def secret(sample: Mapping[str, Any]) -> str:
    return str(sample["ground_truth"])


class CallMarkParser:
    """A turn holding `CALL_MARK` is one call of ``secret`` without arguments."""

    def parse(self, text: str) -> ParsedTurn:
        if CALL_MARK not in text:
            return ParsedTurn(text.strip())
        return ParsedTurn(text.replace(CALL_MARK, "").strip(), [ToolCall("secret", {}, 0, CALL_MARK)])


TOOL_PARSERS = {"call_mark": CallMarkParser}
