"""Mixtral (`MixtralForCausalLM`): Mistral's attention and, in every layer, a router
(`block_sparse_moe.gate`) over `num_local_experts` SwiGLU experts (`w1` gate, `w3` up, `w2` down) of
`intermediate_size`; the top-k router logits are softmaxed, which equals the renormalized top-k of
the full softmax (`ModelShape.moe_norm_topk_prob` is always true here).
"""
from __future__ import annotations

from hybridrl.models.families.llama import EMBEDDING, FINAL_NORM, LLAMA_ATTENTION, LM_HEAD
from hybridrl.models.families.qwen3_moe import moe_weights
from hybridrl.models.family import ArchFamily, DecoderWeights

MIXTRAL_DECODER = DecoderWeights(
    embedding=EMBEDDING,
    layer=LLAMA_ATTENTION + moe_weights("block_sparse_moe", "block_sparse_moe", "w1", "w3", "w2"),
    final_norm=FINAL_NORM,
    lm_head=LM_HEAD,
)

FAMILY = ArchFamily("MixtralForCausalLM", "mixtral", qkv_bias=False, qk_norm=False, default_max_positions=131072,
                    weights=MIXTRAL_DECODER, moe=True, default_num_kv_heads=8, default_rms_norm_eps=1e-5,
                    default_rope_theta=1e6)
