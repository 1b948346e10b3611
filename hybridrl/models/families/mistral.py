"""Mistral (`MistralForCausalLM`): the Llama block; its sliding window is read by `ModelShape`."""
from __future__ import annotations

from hybridrl.models.families.llama import LLAMA_DECODER
from hybridrl.models.family import ArchFamily

FAMILY = ArchFamily("MistralForCausalLM", "mistral", qkv_bias=False, qk_norm=False, default_max_positions=131072,
                    weights=LLAMA_DECODER, default_num_kv_heads=8, default_sliding_window=4096)
