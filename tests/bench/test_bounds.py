"""bench/bounds: the step's lower bound against hand arithmetic, with given rates."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import bounds  # noqa: E402

RATES = {"train_flops_per_s": 1e11, "decode_flops_per_s": 5e10, "copy_bytes_per_s": 1e10}


def test_update_and_generation_bounds_by_hand():
    config = json.loads((ROOT / "configs/models/bench-30m/config.json").read_text())
    # 8 layers of q,k,v,o (4 x 512 x 512) + gate,up,down (3 x 512 x 1536), plus the lm_head (96 x 512)
    body, head = 8 * (4 * 512 * 512 + 3 * 512 * 1536), 96 * 512
    weights = body + head
    assert bounds.matmul_params(config) == weights
    out = bounds.step_bound(config, dtype="bf16", sequences=64, prompt_tokens=16, response_tokens=4, ranks=2,
                            rates=RATES)
    per_rank, seq = 32, 20
    attention = 2 * 2 * 8 * 8 * 64 * seq * seq / 2            # QK^T and AV over the causal half
    # the layers over all 20 tokens, the lm_head over the 4 response tokens only
    update = 3 * per_rank * (2 * body * seq + 2 * head * 4 + attention) / 1e11
    assert out["bound_s/update"] == pytest.approx(update)
    kv_token = 2 * 8 * 8 * 64 * 2                                # K and V, 8 layers, 8 heads x 64, bf16
    gen = per_rank * (2 * body * 16 + 2 * head) / 1e11            # prefill: the lm_head at the last position
    for t in range(4):
        context = 16 + t
        flops = per_rank * (2 * weights + 4 * 8 * 8 * 64 * context) / 5e10
        traffic = (weights * 2 + per_rank * context * kv_token) / 1e10
        gen += max(flops, traffic)
    assert out["bound_s/gen"] == pytest.approx(gen)
    assert out["bound_s/step"] == pytest.approx(gen + update)


def test_update_bound_with_a_prompt_shared_by_its_group_by_hand():
    """prompt_group=8 (`model.shared_prefix`): a group of 8 rows computes its 16 prompt tokens once."""
    config = json.loads((ROOT / "configs/models/bench-30m/config.json").read_text())
    body, head = 8 * (4 * 512 * 512 + 3 * 512 * 1536), 96 * 512
    out = bounds.step_bound(config, dtype="bf16", sequences=64, prompt_tokens=16, response_tokens=4, ranks=2,
                            rates=RATES, prompt_group=8)
    per_rank = 32
    # per group: the prompt's 16 tokens once (its causal self-attention 16^2 / 2 once), then each of the 8
    # responses' 4 tokens attending to the 16 prompt tokens and causally to themselves (4^2 / 2)
    group_attention = 2 * 2 * 8 * 8 * 64 * (16 * 16 / 2 + 8 * (16 * 4 + 4 * 4 / 2))
    group = 2 * body * (16 + 8 * 4) + 8 * 2 * head * 4 + group_attention
    assert out["bound_s/update"] == pytest.approx(3 * (per_rank / 8) * group / 1e11)
    alone = bounds.step_bound(config, dtype="bf16", sequences=64, prompt_tokens=16, response_tokens=4, ranks=2,
                              rates=RATES)
    assert out["bound_s/update"] < 0.5 * alone["bound_s/update"]
    assert out["bound_s/gen"] == alone["bound_s/gen"]  # generation is unchanged


def test_bound_of_run_takes_the_mean_prompt_from_the_token_count():
    run = bounds.bound_of_run("configs/models/bench-30m/config.json", dtype="fp32", prompts=2, n=4,
                              response_tokens=10, ranks=1, micro_batch=4, tokens_per_step=8 * 10 + 8 * 12)
    config = json.loads((ROOT / "configs/models/bench-30m/config.json").read_text())
    rates = bounds.measured_rates("fp32", 512, 1536, 8, 4 * 22)
    direct = bounds.step_bound(config, dtype="fp32", sequences=8, prompt_tokens=12, response_tokens=10,
                               micro_batch=4, rates=rates)
    assert run == direct
