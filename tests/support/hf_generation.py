"""transformers' side of the rollout tests: a generated batch's rows without padding, and the HF model's greedy
continuation and logits of a prompt + response (the reference vLLM's tokens and log-probs are checked against).
Shared by tests/rollout/test_engine.py and tests/reshard/test_resharder.py."""
from __future__ import annotations

import torch


def response_rows(batch):
    """(prompt tokens, response tokens, rollout log-probs) per row, without padding."""
    t = batch.tensors
    width_p = t["prompts"].shape[1]
    for row in range(len(batch)):
        prompt = t["prompts"][row][t["attention_mask"][row, :width_p].bool()].tolist()
        length = int(t["response_lengths"][row])
        yield prompt, t["responses"][row, :length].tolist(), t["rollout_log_probs"][row, :length]


@torch.no_grad()
def hf_logits_of(model, prompt, response):
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[0, len(prompt) - 1: len(prompt) + len(response) - 1]
    return logits.double()


@torch.no_grad()
def hf_greedy(model, prompt, max_tokens):
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()
