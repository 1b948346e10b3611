"""The local spec's norm under sequence parallelism (`hybridrl/parallel/sequence_parallel_norm.py`), against the
torch norm of megatron's local spec it replaces, and the spec the bridge builds with it. Its training behaviour at
TP2 with SP is checked against TP1 in tests/training/test_ranks.py (actor) and against plain torch in
tests/training/test_critic.py (critic and reward model)."""
from __future__ import annotations

import pytest
import torch

from hybridrl.parallel.sequence_parallel_norm import SequenceParallelTorchNorm, with_sequence_parallel_norms


def _config(**overrides):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(num_layers=2, hidden_size=64, num_attention_heads=4, normalization="RMSNorm",
                  use_cpu_initialization=True)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_the_tagged_norm_gives_the_local_specs_norm_numbers_and_tags_its_weights(normalization):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    local = WrappedTorchNorm(_config(normalization=normalization), 64, eps=1e-6)
    tagged = SequenceParallelTorchNorm(_config(normalization=normalization, sequence_parallel=True,
                                                 tensor_model_parallel_size=2), 64, eps=1e-6)
    assert type(tagged) is type(local)
    with torch.no_grad():
        for a, b in zip(local.parameters(), tagged.parameters()):
            a.uniform_(0.5, 1.5)
            b.copy_(a)
    x = torch.randn(5, 2, 64)
    assert torch.equal(local(x), tagged(x))
    assert all(p.sequence_parallel is True for p in tagged.parameters())
    off = SequenceParallelTorchNorm(_config(normalization=normalization), 64)
    assert all(p.sequence_parallel is False for p in off.parameters())


def test_the_tagged_norm_refuses_what_the_torch_norm_cannot_compute():
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


@pytest.mark.parametrize("cpu_layer", [False, True])
def test_the_bridge_builds_the_local_spec_with_tagged_norms_under_sequence_parallelism(cpu_layer):
    """Off the CPU layer too (a GPU without TE, a LoRA actor on any GPU: `layer_spec_kind`): under sequence
    parallelism every norm of the local spec is the tagged one (megatron's own would assert), its core attention
    PyTorch's fused one off the CPU layer and the CPU layer's stand-in on it; without SP the norms are megatron's."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from hybridrl.models.arch import ModelShape
    from hybridrl.models.bridge import layer_spec
    from hybridrl.models.layout import StageChunk
    from hybridrl.parallel.sdpa_attention import sdpa_attention_class

    shape = ModelShape.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False})
    chunk = StageChunk(pp_rank=0, vp_stage=None, first_layer=0, num_layers=3, pre_process=True, post_process=True)
    split = layer_spec(shape, "local", _config(num_layers=3, sequence_parallel=True, tensor_model_parallel_size=2),
                       chunk, cpu_layer=cpu_layer)
    layer = split.layer_specs[0].submodules
    assert split.layer_norm is SequenceParallelTorchNorm
    assert layer.input_layernorm is SequenceParallelTorchNorm and layer.pre_mlp_layernorm is SequenceParallelTorchNorm
    core = layer.self_attention.submodules.core_attention
    assert (core is sdpa_attention_class()) is not cpu_layer and core is not DotProductAttention
    whole = layer_spec(shape, "local", _config(num_layers=3), chunk, cpu_layer=False)
    assert whole.submodules.input_layernorm is WrappedTorchNorm
