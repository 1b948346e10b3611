"""The shape of a Hugging Face causal LM, read from its `config.json` without torch.

The planner needs heads, layers, vocab and parameter counts to validate layouts and estimate
memory before any process starts; the model bridge (`hybridrl.models`) maps the same fields to
megatron. Architectures listed here are the ones the bridge can build.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}


class UnsupportedArchitectureError(ValueError):
    pass


@dataclass(frozen=True)
class ModelShape:
    architecture: str
    family: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelShape:
        architectures = config.get("architectures") or []
        architecture = architectures[0] if architectures else str(config.get("model_type", "<none>"))
        family = SUPPORTED_ARCHITECTURES.get(architecture)
        if family is None:
            raise UnsupportedArchitectureError(
                f"architectures={architectures!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            architecture=architecture,
            family=family,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 always carries q/k/v biases; Llama-style configs say so with attention_bias.
            qkv_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
            qk_norm=family == "qwen3",
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelShape:
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()))

    # Parameter counts, by the pieces that live on different pipeline stages.
    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def output_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def attention_params(self) -> int:
        q_width = self.num_attention_heads * self.head_dim
        kv_width = self.num_key_value_heads * self.head_dim
        params = self.hidden_size * (q_width + 2 * kv_width) + q_width * self.hidden_size
        if self.qkv_bias:
            params += q_width + 2 * kv_width
        if self.qk_norm:
            params += 2 * self.head_dim
        return params

    @property
    def mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size  # gate, up, down

    @property
    def layer_params(self) -> int:
        return self.attention_params + self.mlp_params + 2 * self.hidden_size  # + two RMSNorms

    @property
    def total_params(self) -> int:
        return self.embedding_params + self.num_layers * self.layer_params + self.hidden_size + self.output_params

    def kv_bytes_per_token(self, bytes_per_value: int, tp: int = 1) -> int:
        """KV-cache bytes one token costs on one of `tp` ranks (KV heads replicate when tp > kv)."""
        kv_heads_per_rank = max(1, self.num_key_value_heads // tp)
        return 2 * self.num_layers * kv_heads_per_rank * self.head_dim * bytes_per_value
