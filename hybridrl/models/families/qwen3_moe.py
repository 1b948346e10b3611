"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (q/k norms; unlike Qwen3's, an absent head_dim is
hidden_size // num_attention_heads) and, in each
MoE layer, a router (`mlp.gate`) over `num_experts` SwiGLU experts of `moe_intermediate_size`, top-k
of the router's softmax, renormalized when `norm_topk_prob`. Layers listed in `mlp_only_layers`
(or off the `decoder_sparse_step` grid) keep the dense MLP of `intermediate_size`.

Megatron names are the local spec's MoE layer (`mlp.router`, `mlp.experts.local_experts.{e}` with
SequentialMLP), checked against megatron-core 0.16.1 by tests/models/test_moe.py. The vLLM names
are vLLM 0.32's fused MoE parameters (`experts.routed_experts.w13_weight` [E, 2I/tp, H],
`experts.routed_experts.w2_weight` [E, H, I/tp], router `gate.weight`), each expert one slot of the
stacked parameter (`models.vllm_layout`), checked against vLLM's own loader by
tests/reshard/test_moe.py.
"""
from __future__ import annotations

from dataclasses import replace

from hybridrl.models.families.llama import EMBEDDING, FINAL_NORM, LLAMA_ATTENTION, LLAMA_MLP, LM_HEAD
from hybridrl.models.family import ArchFamily, DecoderWeights, HFTensor, MLPKind, Split, WeightSpec

_HF = "model.layers.{i}"
_MC = "decoder.layers.{i}"


def moe_weights(hf_moe: str, vllm_moe: str, gate: str, up: str, down: str) -> tuple[WeightSpec, ...]:
    """The router and the per-expert SwiGLU weights of an MoE layer whose HF module is `hf_moe`
    (`mlp`, Mixtral's `block_sparse_moe`) and whose experts are `{hf_moe}.experts.{e}.{gate|up|down}`."""
    expert = f"{_HF}.{hf_moe}.experts.{{e}}"
    local = f"{_MC}.mlp.experts.local_experts.{{e}}"
    stacked = f"{_HF}.{vllm_moe}.experts.routed_experts"  # vLLM: every expert of the layer, stacked
    return (
        WeightSpec((HFTensor(f"{_HF}.{hf_moe}.gate.weight", ("experts", "hidden")),),
                   f"{_MC}.mlp.router.weight", f"{_HF}.{vllm_moe}.gate.weight", Split.REPLICATED,
                   mlp=MLPKind.MOE),
        WeightSpec((HFTensor(f"{expert}.{gate}.weight", ("moe_ffn", "hidden")),
                    HFTensor(f"{expert}.{up}.weight", ("moe_ffn", "hidden"))),
                   f"{local}.linear_fc1.weight", f"{stacked}.w13_weight", Split.FUSED_COLUMN,
                   mlp=MLPKind.MOE, expert=True),
        WeightSpec((HFTensor(f"{expert}.{down}.weight", ("hidden", "moe_ffn")),),
                   f"{local}.linear_fc2.weight", f"{stacked}.w2_weight", Split.ROW,
                   mlp=MLPKind.MOE, expert=True),
    )


QWEN3_MOE_DECODER = DecoderWeights(
    embedding=EMBEDDING,
    layer=LLAMA_ATTENTION + tuple(replace(spec, mlp=MLPKind.DENSE) for spec in LLAMA_MLP)
    + moe_weights("mlp", "mlp", "gate_proj", "up_proj", "down_proj"),
    final_norm=FINAL_NORM,
    lm_head=LM_HEAD,
)

FAMILY = ArchFamily("Qwen3MoeForCausalLM", "qwen3_moe", qkv_bias=False, qk_norm=True, default_max_positions=32768,
                    weights=QWEN3_MOE_DECODER, moe=True, default_num_kv_heads=4)
