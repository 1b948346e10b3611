"""megatron's local layer spec's core attention through PyTorch's fused `scaled_dot_product_attention`.

megatron-core's local spec (what a GPU without TransformerEngine builds, and what a model with LoRA adapters builds
on any GPU: `device.layer_spec_kind`) computes attention in `DotProductAttention`: every row's whole s x s scores
in a preallocated buffer, the causal mask filled into them, a softmax in fp32 and a product with V. It holds the
softmax's output for the backward (6 bytes a score element in bf16: 5.9 GiB for one layer of 4 rows of 3,072
tokens with 28 heads) and streams the scores through memory several times a pass; nothing of it is fused.

`SdpaDotProductAttention` takes its place in the local spec off the CPU layer: the same inputs (`[s, b, heads, d]`
queries, `[s, b, groups, d]` keys and values), the same output (`[s, b, heads * d]`), the same causal self-attention
at the same scale, computed by `torch.nn.functional.scaled_dot_product_attention`, which dispatches to a fused
kernel (FlashAttention-2 on GPUs for bf16/fp16, the memory-efficient kernel for fp32; its flash kernel on CPU):
the scores never reach memory, the causal half alone is computed, the backward recomputes them from the saved
log-sum-exp. Everything else about the layer is megatron's (its projections, RoPE, the GQA groups, dropout's RNG
stream). What it does not serve falls back to megatron's own forward unchanged: an explicit attention mask or
bias, packed sequences (which megatron's asserts against), a non-causal mask type, and megatron's softmax variants
(off-by-one, learnable offsets) and sliding windows, refused when the layer is built.

On CPU the CPU layer's stand-in (`parallel.cpu.attention`, which also serves packed sequences and context
parallelism) runs instead; this class is tested there against megatron's `DotProductAttention` (values and
gradients, fp32 and bf16, GQA) and for what autograd keeps (tests/parallel/test_sdpa_attention.py).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F


@functools.cache
def sdpa_attention_class() -> type:
    """The `SdpaDotProductAttention` class (built once: it subclasses a megatron class, imported lazily)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SdpaDotProductAttention(DotProductAttention):
        """megatron's `DotProductAttention`, its causal self-attention computed by PyTorch's fused kernel."""

        def __init__(self, config: Any, layer_number: int, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, layer_number, *args, **kwargs)
            if config.softmax_type != "vanilla" or config.window_size is not None:
                raise ValueError(f"the fused local attention serves megatron's vanilla softmax without a window; "
                                 f"softmax_type={config.softmax_type!r}, window_size={config.window_size!r}")
            # megatron divides the scores by the layer number before its softmax and multiplies them back inside it
            # (apply_query_key_layer_scaling): the net scale is softmax_scale x that coefficient
            self.net_scale = self.softmax_scale * (self.layer_number if config.apply_query_key_layer_scaling else 1)

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                    attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
            mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            if (attention_mask is not None or attention_bias is not None or packed_seq_params is not None
                    or mask_type != AttnMaskType.causal):
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                       packed_seq_params)
            # [s, b, heads, d] -> [b, heads, s, d]; GQA: each key/value group repeated for its queries, as megatron's
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            dropout = self.attention_dropout.p if self.training else 0.0

            def attend() -> torch.Tensor:
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=query.size(0) > 1,
                                                      scale=self.net_scale)

            if dropout and not self.config.sequence_parallel:  # megatron's RNG stream for attention dropout
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    context = attend()
            else:
                context = attend()
            # [b, heads, s, d] -> [s, b, heads * d]
            return context.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), self.hidden_size_per_partition)

    return SdpaDotProductAttention
