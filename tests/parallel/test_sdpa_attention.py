"""The local spec's fused core attention (`hybridrl/parallel/sdpa_attention.py`) against megatron's own
`DotProductAttention`, which it replaces off the CPU layer: the same outputs and input gradients (fp32 and bf16, with
and without grouped-query attention), none of the s x s scores kept for the backward, megatron's path where it does
not serve (an explicit mask), and the bridge's local spec built with it off the CPU layer."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.forked import run_ranks


def _attention_rank(rank: int, world: int, dtype_name: str, groups: int) -> dict[str, Any]:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from hybridrl.parallel.cpu.layer import apply_cpu_layer
    from hybridrl.parallel.sdpa_attention import sdpa_attention_class

    apply_cpu_layer()  # megatron asks "cuda" for its buffers: the CPU layer maps them here
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=groups,
                               use_cpu_initialization=True, bf16=dtype == torch.bfloat16, params_dtype=dtype,
                               masked_softmax_fusion=False, attention_dropout=0.0)
    s, b, heads, d = 24, 3, 4, 16
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(s, b, n, d, generator=gen).to(device="cuda", dtype=dtype) for n in (heads, groups, groups)]
    grad_out = torch.randn(s, b, heads * d, generator=gen).to(device="cuda", dtype=dtype)
    out: dict[str, Any] = {}
    for name, cls in (("megatron", DotProductAttention), ("sdpa", sdpa_attention_class())):
        attention = cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        q, k, v = (t.clone().requires_grad_(True) for t in inputs)
        kept: list[int] = []

        def pack(t: torch.Tensor, kept: list[int] = kept) -> torch.Tensor:
            kept.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            context = attention(q, k, v, attention_mask=None)
        context.backward(grad_out)
        out[name] = {"context": context.detach().float().cpu(), "grads": [t.grad.float().cpu() for t in (q, k, v)],
                     "scores_kept": sum(n == b * heads * s * s for n in kept)}
        # an explicit mask: megatron's own path (the fused one serves the causal mask alone)
        masked = torch.zeros(b, 1, s, s, dtype=torch.bool, device="cuda")
        masked[..., 0] = True
        out[name]["masked"] = attention(*inputs, attention_mask=masked).detach().float().cpu()
    return out


@pytest.mark.parametrize("dtype,groups,tolerance", [("fp32", 4, 1e-5), ("fp32", 2, 1e-5), ("bf16", 2, 3e-2)])
def test_the_fused_local_attention_equals_megatrons_and_keeps_no_scores(dtype, groups, tolerance):
    (result,) = run_ranks(_attention_rank, 1, dtype, groups)
    megatron, sdpa = result["megatron"], result["sdpa"]
    scale = float(megatron["context"].abs().max())
    assert float((sdpa["context"] - megatron["context"]).abs().max()) <= tolerance * scale
    for got, want in zip(sdpa["grads"], megatron["grads"], strict=True):  # query, key, value
        assert float((got - want).abs().max()) <= tolerance * float(want.abs().max())
    assert megatron["scores_kept"] >= 1 and sdpa["scores_kept"] == 0  # megatron keeps its softmax; the fused none
    assert torch.equal(sdpa["masked"], megatron["masked"])  # an explicit mask runs megatron's own forward


def test_the_bridge_builds_the_fused_attention_off_the_cpu_layer_only():
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from hybridrl.models.arch import ModelShape
    from hybridrl.models.bridge import layer_spec
    from hybridrl.parallel.cpu.attention import cpu_packed_attention_class
    from hybridrl.parallel.sdpa_attention import sdpa_attention_class

    shape = ModelShape.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False})
    core = {cpu: layer_spec(shape, "local", cpu_layer=cpu).submodules.self_attention.submodules.core_attention
            for cpu in (False, True)}
    assert core[False] is sdpa_attention_class() and core[True] is cpu_packed_attention_class()
    megatrons = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    assert megatrons.submodules.self_attention.submodules.core_attention is DotProductAttention  # untouched
