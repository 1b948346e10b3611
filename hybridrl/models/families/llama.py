"""Llama (`LlamaForCausalLM`): RMSNorm, RoPE, SwiGLU MLP, grouped-query attention.

The weight table here is the dense Llama block; Mistral, Qwen2 and Qwen3 reuse it with their
switches (`qkv_bias`, `qk_norm`). Names are megatron-core 0.16.1's local GPT layer spec and vLLM
0.32's `LlamaForCausalLM` (checked against both in tests/models/test_arch.py and
tests/reshard/test_layout.py).
"""
from __future__ import annotations

from hybridrl.models.family import ArchFamily, DecoderWeights, HFTensor, Split, WeightSpec

_HF = "model.layers.{i}"
_MC = "decoder.layers.{i}"


def _layer(hf: str, dims: tuple[str, ...]) -> HFTensor:
    return HFTensor(f"{_HF}.{hf}", dims)


# The attention half of a decoder layer, with the pre-MLP norm (every family shares it).
LLAMA_ATTENTION: tuple[WeightSpec, ...] = (
    WeightSpec((_layer("input_layernorm.weight", ("hidden",)),),
               f"{_MC}.input_layernorm.weight", f"{_HF}.input_layernorm.weight", Split.REPLICATED),
    WeightSpec((_layer("self_attn.q_proj.weight", ("q", "hidden")),
                _layer("self_attn.k_proj.weight", ("kv", "hidden")),
                _layer("self_attn.v_proj.weight", ("kv", "hidden"))),
               f"{_MC}.self_attention.linear_qkv.weight", f"{_HF}.self_attn.qkv_proj.weight", Split.QKV),
    WeightSpec((_layer("self_attn.q_proj.bias", ("q",)),
                _layer("self_attn.k_proj.bias", ("kv",)),
                _layer("self_attn.v_proj.bias", ("kv",))),
               f"{_MC}.self_attention.linear_qkv.bias", f"{_HF}.self_attn.qkv_proj.bias", Split.QKV,
               when="qkv_bias"),
    WeightSpec((_layer("self_attn.q_norm.weight", ("head_dim",)),),
               f"{_MC}.self_attention.q_layernorm.weight", f"{_HF}.self_attn.q_norm.weight", Split.REPLICATED,
               when="qk_norm"),
    WeightSpec((_layer("self_attn.k_norm.weight", ("head_dim",)),),
               f"{_MC}.self_attention.k_layernorm.weight", f"{_HF}.self_attn.k_norm.weight", Split.REPLICATED,
               when="qk_norm"),
    WeightSpec((_layer("self_attn.o_proj.weight", ("hidden", "q")),),
               f"{_MC}.self_attention.linear_proj.weight", f"{_HF}.self_attn.o_proj.weight", Split.ROW),
    WeightSpec((_layer("post_attention_layernorm.weight", ("hidden",)),),
               f"{_MC}.pre_mlp_layernorm.weight", f"{_HF}.post_attention_layernorm.weight", Split.REPLICATED),
)

# The dense SwiGLU MLP.
LLAMA_MLP: tuple[WeightSpec, ...] = (
    WeightSpec((_layer("mlp.gate_proj.weight", ("ffn", "hidden")),
                _layer("mlp.up_proj.weight", ("ffn", "hidden"))),
               f"{_MC}.mlp.linear_fc1.weight", f"{_HF}.mlp.gate_up_proj.weight", Split.FUSED_COLUMN),
    WeightSpec((_layer("mlp.down_proj.weight", ("hidden", "ffn")),),
               f"{_MC}.mlp.linear_fc2.weight", f"{_HF}.mlp.down_proj.weight", Split.ROW),
)

EMBEDDING = WeightSpec((HFTensor("model.embed_tokens.weight", ("vocab", "hidden")),),
                       "embedding.word_embeddings.weight", "model.embed_tokens.weight", Split.VOCAB)
FINAL_NORM = WeightSpec((HFTensor("model.norm.weight", ("hidden",)),),
                        "decoder.final_layernorm.weight", "model.norm.weight", Split.REPLICATED)
LM_HEAD = WeightSpec((HFTensor("lm_head.weight", ("vocab", "hidden")),),
                     "output_layer.weight", "lm_head.weight", Split.VOCAB)

LLAMA_DECODER = DecoderWeights(embedding=EMBEDDING, layer=LLAMA_ATTENTION + LLAMA_MLP, final_norm=FINAL_NORM,
                               lm_head=LM_HEAD)

FAMILY = ArchFamily("LlamaForCausalLM", "llama", qkv_bias=False, qk_norm=False, default_max_positions=2048,
                    weights=LLAMA_DECODER)
