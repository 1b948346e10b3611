"""Rollout batches from different replicas must line up column for column."""
import torch

from hybridrl.data.batch import Batch
from hybridrl.workers.generation import left_pad_prompts


def two_rows(**extra: torch.Tensor) -> Batch:
    """Two rollout rows of prompt width 2 (the second row's prompt one token long) and response width 3."""
    return Batch({
        "prompts": torch.tensor([[5, 6], [0, 7]]),
        "responses": torch.tensor([[8, 9, 0], [8, 0, 0]]),
        "input_ids": torch.tensor([[5, 6, 8, 9, 0], [0, 7, 8, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 0, 0]]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 4], [0, 0, 1, 2, 3]]),
        "response_mask": torch.tensor([[1, 1, 0], [1, 0, 0]]),
        **extra,
    })


def test_left_pad_prompts_widens_only_the_prompt_side():
    batch = two_rows()
    out = left_pad_prompts(batch, 4, pad_token_id=0)
    assert out["input_ids"].tolist() == [[0, 0, 5, 6, 8, 9, 0], [0, 0, 0, 7, 8, 0, 0]]
    assert out["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 0, 0, 1, 2, 3, 4], [0, 0, 0, 0, 1, 2, 3]]
    assert out["prompts"].shape == (2, 4) and out["responses"].shape == (2, 3)
    same = left_pad_prompts(out, 3, pad_token_id=0)
    assert same["input_ids"].shape == (2, 7)


def test_left_pad_prompts_keeps_the_routed_experts_aligned_with_the_tokens():
    """Routing replay: `routed_experts` [rows, P+R, moe_layers, top_k] is aligned with `input_ids`, so
    a replica's narrower prompts widen it too, with -1 (vLLM routed nothing there)."""
    routed = torch.arange(2 * 5 * 3 * 2, dtype=torch.int16).reshape(2, 5, 3, 2) % 4
    routed[1, 0] = -1  # the second row's prompt padding
    batch = two_rows(routed_experts=routed.clone())
    out = left_pad_prompts(batch, 4, pad_token_id=0)
    assert out["routed_experts"].shape == (2, 7, 3, 2) and out["routed_experts"].dtype == torch.int16
    assert (out["routed_experts"][:, :2] == -1).all()
    assert torch.equal(out["routed_experts"][:, 2:], routed)
