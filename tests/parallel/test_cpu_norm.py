"""The CPU stand-in for TE's norm under sequence parallelism (`hybridrl/parallel/cpu/norm.py`), against the
torch norm of megatron's local spec it replaces. The stand-in's training behaviour at TP2 with SP is checked
against TP1 in tests/training/test_ranks.py (actor) and against plain torch in tests/training/test_critic.py
(critic and reward model)."""
from __future__ import annotations

import pytest
import torch

from hybridrl.parallel.cpu.norm import SequenceParallelTorchNorm, with_sequence_parallel_norms


def _config(**overrides):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(num_layers=2, hidden_size=64, num_attention_heads=4, normalization="RMSNorm",
                  use_cpu_initialization=True)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_stand_in_gives_the_local_specs_norm_numbers_and_tags_its_weights(normalization):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    local = WrappedTorchNorm(_config(normalization=normalization), 64, eps=1e-6)
    stand_in = SequenceParallelTorchNorm(_config(normalization=normalization, sequence_parallel=True,
                                                 tensor_model_parallel_size=2), 64, eps=1e-6)
    assert type(stand_in) is type(local)
    with torch.no_grad():
        for a, b in zip(local.parameters(), stand_in.parameters()):
            a.uniform_(0.5, 1.5)
            b.copy_(a)
    x = torch.randn(5, 2, 64)
    assert torch.equal(local(x), stand_in(x))
    assert all(p.sequence_parallel is True for p in stand_in.parameters())
    off = SequenceParallelTorchNorm(_config(normalization=normalization), 64)
    assert all(p.sequence_parallel is False for p in off.parameters())


def test_stand_in_refuses_what_the_torch_norm_cannot_compute():
    with pytest.raises(ValueError, match="zero-centered gamma"):
        SequenceParallelTorchNorm(_config(layernorm_zero_centered_gamma=True, normalization="LayerNorm"), 64)


def test_every_torch_norm_of_a_local_spec_is_replaced():
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    block = with_sequence_parallel_norms(spec, num_layers=3)
    assert len(block.layer_specs) == 3 and block.layer_norm is SequenceParallelTorchNorm
    layer = block.layer_specs[0].submodules
    attention = layer.self_attention.submodules
    norms = [layer.input_layernorm, layer.pre_mlp_layernorm, attention.q_layernorm, attention.k_layernorm]
    assert norms == [SequenceParallelTorchNorm] * 4
    assert WrappedTorchNorm not in norms
