"""Qwen2 (`Qwen2ForCausalLM`): the Llama block with biases on q, k and v."""
from __future__ import annotations

from hybridrl.models.families.llama import LLAMA_DECODER
from hybridrl.models.family import ArchFamily

FAMILY = ArchFamily("Qwen2ForCausalLM", "qwen2", qkv_bias=True, qk_norm=False, default_max_positions=32768,
                    weights=LLAMA_DECODER, default_num_kv_heads=32)
