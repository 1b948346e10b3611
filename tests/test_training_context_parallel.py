"""Context parallelism on CPU: the attention stand-in's all-gathered keys and values, megatron's
load-balanced sequence split, and the training backend at CP2 against CP1 and transformers.

The references are independent of the code under test: plain torch attention over the whole sequence
(written here), transformers' per-row log-probs, and the same job at CP1.
"""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from hybridrl.parallel.context_parallel import cp_columns
from hybridrl.parallel.forked import run_ranks

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def test_cp_columns_are_megatrons_load_balanced_chunks():
    # 16 columns, CP2: four chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert cp_columns(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_columns(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # CP4 over 8 columns: chunk size 1, rank r holds r and 7 - r
    assert [cp_columns(8, 4, r).tolist() for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    with pytest.raises(ValueError, match="2 × CP = 4"):
        cp_columns(10, 2, 0)


def torch_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention of one sequence: q `[s, h, d]`, k/v `[s, kv, d]` -> `[s, h * d]`."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    causal = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(q.shape[0], -1)


def _attention_rank(rank: int, world: int, seq: int, batch: int) -> dict[str, Any]:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from hybridrl.parallel import state
    from hybridrl.parallel.cpu_attention import cpu_packed_attention_class
    from hybridrl.parallel.cpu_layer import CPU_CONFIG_OVERRIDES

    ctx = state.initialize_model_parallel(tp=1, cp=world, device="cpu")
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=KV_HEADS, kv_channels=HEAD_DIM, context_parallel_size=world,
                               attention_dropout=0.0, hidden_dropout=0.0, **CPU_CONFIG_OVERRIDES)
    # the whole sequence, the same on every rank; each rank takes its columns
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(seq, batch, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(seq, batch, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(seq, batch, KV_HEADS, HEAD_DIM, generator=gen)
    weight = torch.randn(seq, batch, HEADS * HEAD_DIM, generator=gen)
    columns = cp_columns(seq, world, ctx.cp_rank)
    local = [t[columns].clone().requires_grad_(True) for t in (q, k, v)]
    stand_in = cpu_packed_attention_class()(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                            attention_type="self")
    out = stand_in(*local, None, attn_mask_type=AttnMaskType.causal)
    # the CP ranks' losses add up to the whole sequence's: the gradient of a key sums over every rank's queries
    (out * weight[columns]).sum().backward()

    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = torch.stack([torch_causal_attention(*(t[:, i] for t in full)) for i in range(batch)], dim=1)
    (ref * weight).sum().backward()
    refused = None
    try:
        DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    except AssertionError as err:
        refused = str(err)
    with torch.no_grad():  # the local queries against the local keys only: the test can tell the gather
        alone = super(type(stand_in), stand_in).forward(*(t.detach() for t in local), None,
                                                         attn_mask_type=AttnMaskType.causal)
    return {
        "shape": tuple(out.shape),
        "out_vs_torch": float((out - ref[columns]).abs().max()),
        "grad_vs_torch": [float((a.grad - b.grad[columns]).abs().max()) for a, b in zip(local, full)],
        "grad_scale": min(float(a.grad.abs().max()) for a in local),
        "local_only_gap": float((alone - ref[columns].detach()).abs().max()),
        "megatron_refuses": refused,
    }


def test_cpu_attention_stand_in_under_cp2_equals_plain_torch():
    """CP2, GQA (4 query heads, 2 KV heads), two sequences of 12 columns: output and q/k/v grads."""
    results = run_ranks(_attention_rank, 2, 12, 2)
    for r in results:
        assert r["shape"] == (6, 2, HEADS * HEAD_DIM)
        assert r["out_vs_torch"] < 1e-6, r
        assert max(r["grad_vs_torch"]) < 1e-5 and r["grad_scale"] > 1e-2, r
        assert r["local_only_gap"] > 1e-2
        assert r["megatron_refuses"] is not None and "Context parallelism" in r["megatron_refuses"]
