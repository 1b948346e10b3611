"""The CPU RoPE in megatron's fused slot gives megatron's unfused numbers, bit for bit, and HF's formula."""
from __future__ import annotations

import pytest
import torch

from hybridrl.parallel.cpu.rope import (
    cpu_fused_rope_installed,
    install_cpu_fused_rope,
    rotary_embedding_half_split,
)


def _inputs(dtype: torch.dtype, head_dim: int, rot_dim: int, halves_equal: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    s, b, h = 37, 3, 4
    # a non-contiguous view, as megatron's query/key come out of the fused qkv projection
    qkv = torch.randn(s, b, h, 3 * head_dim, generator=g).to(dtype)
    t = qkv[..., head_dim:2 * head_dim]
    if halves_equal:  # megatron's RotaryEmbedding (and HF's): the angle table repeated over the halves
        angles = torch.rand(s, rot_dim // 2, generator=g) * 50
        freqs = torch.cat([angles, angles], dim=-1)
    else:  # a table the formula must not assume symmetric
        freqs = torch.rand(s, rot_dim, generator=g) * 50
    return t, freqs[:, None, None, :].float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rot_dim,halves_equal", [(64, 64, True), (64, 64, False), (64, 32, True)])
def test_values_and_gradients_are_megatron_unfused_bit_for_bit(dtype, head_dim, rot_dim, halves_equal):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    t, freqs = _inputs(dtype, head_dim, rot_dim, halves_equal)
    grad = torch.randn(t.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    results = []
    for fn in (_apply_rotary_pos_emb_bshd, rotary_embedding_half_split):
        leaf = t.detach().clone().requires_grad_(True)
        out = fn(leaf, freqs)
        out.backward(grad)
        results.append((out.detach(), leaf.grad))
    (ref_out, ref_grad), (out, grad_in) = results
    assert out.dtype == ref_out.dtype == dtype and out.shape == ref_out.shape
    assert torch.equal(out, ref_out)
    assert torch.equal(grad_in, ref_grad)
    if rot_dim < head_dim:  # the channels past the rotary dimension pass through untouched
        assert torch.equal(out[..., rot_dim:], t[..., rot_dim:])


def test_matches_transformers_llama_rope():
    """An independent reference: HF's `apply_rotary_pos_emb` on [b, h, s, d] with its cos/sin tables."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    t, freqs = _inputs(torch.float32, 64, 64, True)
    cos, sin = freqs[:, 0, 0].cos(), freqs[:, 0, 0].sin()  # [s, d]
    hf_layout = t.permute(1, 2, 0, 3)  # [b, h, s, d]
    expected, _ = apply_rotary_pos_emb(hf_layout, hf_layout, cos[None], sin[None])
    ours = rotary_embedding_half_split(t, freqs).permute(1, 2, 0, 3)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(ours, hf_layout, atol=1e-2)  # RoPE did rotate


def test_gradient_matches_finite_differences():
    t, freqs = _inputs(torch.float64, 8, 8, False)
    leaf = t.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: rotary_embedding_half_split(x, freqs.double()), (leaf,))


def test_refuses_layouts_it_does_not_serve():
    t, freqs = _inputs(torch.float32, 64, 64, True)
    with pytest.raises(ValueError, match="non-interleaved"):
        rotary_embedding_half_split(t, freqs, interleaved=True)
    with pytest.raises(ValueError, match="at most the head size 64"):
        rotary_embedding_half_split(t, torch.zeros(37, 1, 1, 66))


def test_install_fills_megatron_slot_and_cpu_config_check_accepts_fusion():
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings import rope_utils

    from hybridrl.parallel.cpu import layer as cpu_layer

    assert install_cpu_fused_rope() and install_cpu_fused_rope()  # idempotent
    assert cpu_fused_rope_installed()
    assert rope_utils.fused_apply_rotary_pos_emb is rotary_embedding_half_split
    assert rope_utils.fused_apply_rotary_pos_emb_thd is None  # packed sequences keep megatron's path
    cpu_layer.check_config_for_cpu(SimpleNamespace(**{**cpu_layer.CPU_CONFIG_OVERRIDES, "apply_rope_fusion": True}))


def test_bridge_turns_fusion_on_for_cpu_models():
    from hybridrl.models.bridge import ModelSource, transformer_config

    shape = ModelSource.from_path("configs/models/tiny-demo").shape
    config = transformer_config(shape, 1, 1, None, device="cpu", dtype=torch.float32)
    assert config.apply_rope_fusion and cpu_fused_rope_installed()
