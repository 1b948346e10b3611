"""Rotary position embedding for megatron's fused-RoPE slot on CPU: the same numbers, fewer passes.

megatron-core applies RoPE to queries and keys through `rope_utils.apply_rotary_pos_emb`. With
`apply_rope_fusion=True` it calls the module's `fused_apply_rotary_pos_emb` slot (Transformer
Engine's CUDA kernel when TE is installed, else None); without it, `_apply_rotary_pos_emb_bshd`
computes ``t * cos + cat(-x2, x1) * sin`` and then ``cat((t, t_pass))``. On CPU each of those
elementwise ops is a pass over memory, and autograd adds more: the two concatenations, the
negation and the chunk's backward concatenation took ~0.5 s of a 9 s fp32 update of the 30M
benchmark model (torch profiler, 1 core, `aten::cat`). The function below saves 0.2 s of that
update in fp32 and 0.24 s of 5.8 s in bf16 (in-process A/B, alternating).

`rotary_embedding_half_split` fills the slot on CPU (TE cannot be installed there). It writes
each half of the output in place::

    out[..., :h] = x1 * cos1 - x2 * sin1        out[..., h:] = x2 * cos2 + x1 * sin2

and its backward does the same with the transposed rotation. Every element goes through the same
roundings as megatron's unfused formula (each product rounded, then one addition; ``a + (-b)`` is
``a - b`` exactly in IEEE arithmetic), so forward values and gradients are bit-identical to it in
fp32 and bf16 (`tests/parallel/test_cpu_rope.py` checks both against megatron's own function).

Only the layout megatron's GPT models use here is served: sbhd tensors, non-interleaved halves,
mscale 1 (megatron itself falls back to the unfused path for mscale != 1). Packed (thd) sequences
call megatron's other slot, `fused_apply_rotary_pos_emb_thd`: `hybridrl.parallel.cpu.attention`
fills it with this rotation at each token's position within its row.
"""
from __future__ import annotations

import torch


class _HalfSplitRotary(torch.autograd.Function):
    """RoPE on the first `rot_dim` channels of `t` (the rest pass through); see the module docstring."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return _rotate(t, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, inverse=True), None, None


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool) -> torch.Tensor:
    """Forward: [x1 c1 - x2 s1, x2 c2 + x1 s2]; inverse (the gradient): [g1 c1 + g2 s2, g2 c2 - g1 s1]."""
    rot_dim = cos.shape[-1]
    half = rot_dim // 2
    x1, x2 = t[..., :half], t[..., half:rot_dim]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    first, second = out[..., :half], out[..., half:rot_dim]
    torch.mul(x1, c1, out=first)
    torch.mul(x2, c2, out=second)
    if inverse:
        first.add_(x2 * s2)
        second.sub_(x1 * s1)
    else:
        first.sub_(x2 * s1)
        second.add_(x1 * s2)
    if rot_dim < t.shape[-1]:
        out[..., rot_dim:] = t[..., rot_dim:]
    return out


def rotary_embedding_half_split(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
                                interleaved: bool = False) -> torch.Tensor:
    """megatron's fused-RoPE slot signature (TE's): `t` [s, b, h, d], `freqs` [s, 1, 1, rot_dim]."""
    if interleaved:
        raise ValueError("rotary_embedding_half_split serves non-interleaved RoPE only (rotary_interleaved=False)")
    if freqs.shape[-1] % 2 or freqs.shape[-1] > t.shape[-1]:
        raise ValueError(f"RoPE dimension {freqs.shape[-1]} must be even and at most the head size {t.shape[-1]}")
    # As megatron's unfused path: angles in the freqs' precision, then cast to the activations' dtype.
    cos = torch.cos(freqs).to(t.dtype)
    sin = torch.sin(freqs).to(t.dtype)
    return _HalfSplitRotary.apply(t, cos, sin)


def install_cpu_fused_rope() -> bool:
    """Put `rotary_embedding_half_split` in megatron's empty fused-RoPE slot; True when it is there.

    Idempotent. A slot TE already filled is left alone (and False returned: the caller keeps the
    unfused path on CPU, where TE's CUDA kernel cannot run)."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = rotary_embedding_half_split
    return cpu_fused_rope_installed()


def cpu_fused_rope_installed() -> bool:
    """Whether megatron's fused-RoPE slot holds `rotary_embedding_half_split`."""
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils.fused_apply_rotary_pos_emb is rotary_embedding_half_split
