"""megatron's local layer spec under sequence parallelism: its torch norm, with its weights tagged as TE's are.

With ``sequence_parallel=True`` megatron keeps the activations between a row-parallel and the next
column-parallel linear split along the sequence over the TP ranks: each rank normalizes its own
tokens, so each rank's norm weight gradient covers only its share of the sequence. The norm must
tag its weights ``sequence_parallel=True`` so that megatron's `finalize_model_grads`
(``_allreduce_non_tensor_model_parallel_grads``) sums those gradients over TP. TE's `TENorm` and
Apex's `FusedLayerNorm` do; megatron's local spec's `WrappedTorchNorm` asserts ``not
config.sequence_parallel`` instead, because it cannot tag. The local spec is what CPU runs (neither TE nor Apex
exists there), what a GPU without TE runs, and what a model with LoRA adapters runs on any device
(`device.layer_spec_kind`: TE fuses the norm into the adapted linear layers).

`SequenceParallelTorchNorm` is that tag on torch's own `RMSNorm` / `LayerNorm`: the numbers are
`WrappedTorchNorm`'s (the same torch module, built the same way, on any device), the weights carry
``sequence_parallel`` as TE's do. Everything else about sequence parallelism is megatron's own code: the
scatter after the embedding, the all-gather in each column-parallel linear and the reduce-scatter in each
row-parallel one (`tensor_parallel.mappings`), the gradient all-reduce of the tagged weights.
`with_sequence_parallel_norms` puts it in place of `WrappedTorchNorm` in a layer or block spec (the bridge
does so for the local spec whenever the job sets sequence parallelism); tests check it against the unsplit
model (tests/parallel/test_sequence_parallel_norm.py, tests/training/test_ranks.py).
"""
from __future__ import annotations

from typing import Any

import torch


class SequenceParallelTorchNorm:
    """`WrappedTorchNorm`'s torch norm, its weights tagged ``sequence_parallel`` like `TENorm`'s."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm") -> torch.nn.Module:
        # the same refusals as WrappedTorchNorm, but for sequence parallelism, which this serves
        if config.layernorm_zero_centered_gamma or config.persist_layer_norm or config.memory_efficient_layer_norm:
            raise ValueError("the torch norm serves neither zero-centered gamma, persist_layer_norm nor "
                             "memory_efficient_layer_norm (as megatron's WrappedTorchNorm)")
        norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in norms:
            raise ValueError(f"normalization {config.normalization!r}: the torch norm serves {sorted(norms)}")
        norm = norms[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


def with_sequence_parallel_norms(spec: Any, num_layers: int) -> Any:
    """A block spec whose every `WrappedTorchNorm` (layer norms, q/k norms, the final norm) is the tagged one.

    `spec` is a layer spec (a dense model's: made into a block of `num_layers` of it, as megatron's
    `TransformerBlock` would) or a block spec (an MoE model's per-layer specs). Specs are changed in
    place (a block's layers may share one spec object).
    """
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if not isinstance(spec, TransformerBlockSubmodules):
        spec = TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=WrappedTorchNorm)

    def swap(holder: Any, field: str) -> None:
        if getattr(holder, field, None) is WrappedTorchNorm:
            setattr(holder, field, SequenceParallelTorchNorm)

    swap(spec, "layer_norm")
    for layer in spec.layer_specs:
        swap(layer.submodules, "input_layernorm")
        swap(layer.submodules, "pre_mlp_layernorm")
        attention = layer.submodules.self_attention.submodules
        swap(attention, "q_layernorm")
        swap(attention, "k_layernorm")
    return spec
