"""A scripted model for the agent-loop tests: fixed turns (tool calls as the hermes parser reads them) with made-up
log-probs, so every expected token, mask and log-prob is computed independently of the loop; and the loop with the
calculator tool around it. Shared by tests/rollout/test_agent_loop.py and tests/training/test_multi_turn.py."""
from __future__ import annotations

import json

from hybridrl.rollout.agent_loop import AgentLoop, AgentLoopSettings, ObservationRenderer, TurnOutput
from hybridrl.tool_calling import build_registry, get_parser


def call(expression: str) -> str:
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


class Script:
    """A model that says `turns[sample][turn]` (text, or None: stop at the budget) and ends with EOS."""

    def __init__(self, tokenizer, turns: list[list[str]], eos: int):
        self.tokenizer, self.turns, self.eos = tokenizer, turns, eos
        self.requests: list[tuple[list[list[int]], list[int], list[tuple[int, int]]]] = []

    def __call__(self, contexts, max_tokens, keys):
        self.requests.append(([list(c) for c in contexts], list(max_tokens), list(keys)))
        outputs = []
        for (sample, turn), limit in zip(keys, max_tokens):
            ids = self.tokenizer.encode(self.turns[sample][turn], add_special_tokens=False) + [self.eos]
            reason = "stop"
            if len(ids) > limit:
                ids, reason = ids[:limit], "length"
            outputs.append(TurnOutput(ids, [-0.01 * (k + 1) - sample for k in range(len(ids))], reason))
        return outputs


def agent_loop(tokenizer, registry=None, max_turns=4, eos=None):
    renderer = ObservationRenderer(tokenizer, end_of_turn_ids=[tokenizer.eos_token_id if eos is None else eos])
    return AgentLoop(registry or build_registry(["calculator"]), get_parser("hermes"), renderer,
                     AgentLoopSettings(max_turns=max_turns))
