"""Qwen3 (`Qwen3ForCausalLM`): the Llama block with an RMSNorm on each query and key head
(megatron's `qk_layernorm`) and an explicit `head_dim` (128 by default)."""
from __future__ import annotations

from hybridrl.models.families.llama import LLAMA_DECODER
from hybridrl.models.family import ArchFamily

FAMILY = ArchFamily("Qwen3ForCausalLM", "qwen3", qkv_bias=False, qk_norm=True, default_max_positions=32768,
                    weights=LLAMA_DECODER, default_head_dim=128, default_num_kv_heads=32)
