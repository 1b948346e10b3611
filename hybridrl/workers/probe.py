"""The weight probe: a short sequence scored by the trainer and by every vLLM replica after each weight
sync. Its max log-prob gap proves that what each replica serves is the trainer's policy (the sync's
checksums prove the bytes; this proves what the repacked, sharded weights compute).

The sequence is a real prompt (the first training prompt, chat template applied; its last
`PROBE_PROMPT_TOKENS` tokens) and vLLM's greedy continuation of it after the first sync: tokens the model
finds likely. There, log-probs are near 0 and half-precision kernels agree closely, so a tolerance
measured on it separates a correct sync from a broken layout; on rare tokens (fixed ids far down the
vocabulary) bf16 kernels differ most and the gap of a correct sync is large. The continuation is made
once, by one replica, and reused by every replica at every later sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridrl.data.batch import Batch
from hybridrl.rollout.sampling import validation_sampling


class WeightSyncError(RuntimeError):
    """A weight sync that could not be proven: checksums differ or the log-prob probe drifted."""


PROBE_PROMPT_TOKENS = 64
PROBE_RESPONSE_TOKENS = 8
# The prompt when a worker is built without one (tests, tools): token ids below every supported vocab.
DEFAULT_PROBE_PROMPT = (1, 5, 9, 13, 17, 21, 25, 29)


@dataclass(frozen=True)
class ProbeSequence:
    """The probe: a prompt and the response both sides score."""

    prompt: tuple[int, ...]
    response: tuple[int, ...]

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt, *self.response]


def probe_prompt_of(prompt_ids: Any | None) -> tuple[int, ...]:
    """The probe's prompt from a real prompt's token ids (its end: where the answer starts)."""
    if prompt_ids is None or len(prompt_ids) == 0:
        return DEFAULT_PROBE_PROMPT
    return tuple(int(t) for t in list(prompt_ids)[-PROBE_PROMPT_TOKENS:])


def continue_probe(rollout: Any, prompt: tuple[int, ...]) -> ProbeSequence:
    """vLLM's greedy continuation of `prompt` on this replica (EOS ignored: always the full length).
    Collective over the replica's TP ranks (vLLM's generation is); every TP rank gets the same tokens."""
    out = rollout.generate_sequences([list(prompt)], validation_sampling(PROBE_RESPONSE_TOKENS, ignore_eos=True))
    length = int(out.tensors["response_lengths"][0])
    return ProbeSequence(tuple(prompt), tuple(int(t) for t in out.tensors["responses"][0, :length].tolist()))


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


def probe_gap_of(rollout: Any, probe: ProbeSequence, trainer_log_probs: list[float]) -> float | None:
    """This replica's max |trainer - vLLM| over the probe's response tokens; None off its TP rank 0.
    Collective over the replica's TP ranks (vLLM's forward is)."""
    vllm_log_probs = rollout.prompt_log_probs(probe.tokens)
    if rollout.tp_rank != 0:
        return None
    ours = torch.tensor(trainer_log_probs, dtype=torch.float64)
    theirs = torch.tensor(vllm_log_probs[len(probe.prompt):], dtype=torch.float64)
    return float((ours - theirs).abs().max())
