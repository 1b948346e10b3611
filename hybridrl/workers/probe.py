"""The weight probe: a fixed short sequence scored by the trainer and by every vLLM replica after each
weight sync. Its max log-prob gap proves that what each replica serves is the trainer's policy (the
sync's checksums prove the bytes; this proves what the repacked, sharded weights compute).

Why rare tokens: a layout error (swapped heads, gate/up halves, a rolled row) barely moves a confident
model's likely tokens, but moves the log-prob of rare ones by whole nats. Measured by
`bench/probe_gap.py` on SmolLM2-135M-Instruct (bench/results/probe_gap_real.json), bf16 rollout: this
probe's correct-sync gap is 0.12 and the smallest single-layer layout error 3.0 (25x apart; the
tolerance 0.5 sits 4x above and 6x below); a real prompt with its greedy continuation gaps 0.039 correct
but only 0.12 for the same error (3x apart), a sampled continuation 0.086 and 0.27: no tolerance
separates those safely.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridrl.data.batch import Batch


class WeightSyncError(RuntimeError):
    """A weight sync that could not be proven: checksums differ or the log-prob probe drifted."""


@dataclass(frozen=True)
class ProbeSequence:
    """A probe: a prompt and the response both sides score."""

    prompt: tuple[int, ...]
    response: tuple[int, ...]

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt, *self.response]


# The sync's probe: token ids below every supported vocabulary, rare in every one of them.
RARE_TOKEN_PROBE = ProbeSequence((1, 5, 9, 13, 17, 21, 25, 29), (33, 37, 41, 45, 49, 53, 57, 61))


def probe_batch(probe: ProbeSequence, pad_token_id: int) -> Batch:
    """The probe as a one-row rollout batch, for the trainer's log-prob pass."""
    prompt, response = torch.tensor([probe.prompt]), torch.tensor([probe.response])
    input_ids = torch.cat([prompt, response], dim=1)
    length = input_ids.shape[1]
    return Batch({
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "position_ids": torch.arange(length).unsqueeze(0),
        "responses": response,
        "response_mask": torch.ones_like(response),
        "prompts": prompt,
    }, meta={"pad_token_id": pad_token_id})


def probe_gap_of(rollout: Any, trainer_log_probs: list[float], probe: ProbeSequence = RARE_TOKEN_PROBE) -> float | None:
    """This replica's max |trainer - vLLM| over the probe's response tokens; None off its TP rank 0.
    Collective over the replica's TP ranks (vLLM's forward is)."""
    vllm_log_probs = rollout.prompt_log_probs(probe.tokens)
    if rollout.tp_rank != 0:
        return None
    ours = torch.tensor(trainer_log_probs, dtype=torch.float64)
    theirs = torch.tensor(vllm_log_probs[len(probe.prompt):], dtype=torch.float64)
    return float((ours - theirs).abs().max())
