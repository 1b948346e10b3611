"""The weight probe: a fixed short sequence scored by the trainer and by every vLLM replica after
each weight sync. Its max log-prob gap proves that what each replica serves is the trainer's policy
(the sync's checksums prove the bytes; this proves what the repacked, sharded weights compute).
"""
from __future__ import annotations

from typing import Any

import torch

from hybridrl.data.batch import Batch


class WeightSyncError(RuntimeError):
    """A weight sync that could not be proven: checksums differ or the log-prob probe drifted."""


# A fixed probe sequence (token ids < every supported vocab): scored after every sync by both sides.
PROBE_PROMPT = (1, 5, 9, 13, 17, 21, 25, 29)
PROBE_RESPONSE = (33, 37, 41, 45, 49, 53, 57, 61)


def probe_batch(pad_token_id: int) -> Batch:
    """The probe as a one-row rollout batch, for the trainer's log-prob pass."""
    prompt, response = torch.tensor([PROBE_PROMPT]), torch.tensor([PROBE_RESPONSE])
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


def probe_gap_of(rollout: Any, trainer_log_probs: list[float]) -> float | None:
    """This replica's max |trainer - vLLM| over the probe's response tokens; None off its TP rank 0.
    Collective over the replica's TP ranks (vLLM's forward is)."""
    vllm_log_probs = rollout.prompt_log_probs(list(PROBE_PROMPT + PROBE_RESPONSE))
    if rollout.tp_rank != 0:
        return None
    ours = torch.tensor(trainer_log_probs, dtype=torch.float64)
    theirs = torch.tensor(vllm_log_probs[len(PROBE_PROMPT):], dtype=torch.float64)
    return float((ours - theirs).abs().max())
