"""Tiny random HF models for the rollout and layout tests (built from configs; never downloaded).

Weights are drawn with a larger spread than HF's init (and biases / norms are randomized too) so
that every tensor's layout matters and greedy decoding has clear winners instead of near-ties.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# head_dim 32: vLLM's CPU attention refuses 16. vocab 200 pads to 256 in vLLM (pad rows exercised).
LLAMA_GQA1: dict[str, Any] = dict(
    family="llama", vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
)
# Qwen2: q/k/v biases, tied embeddings, 2 KV heads.
QWEN2_TIED: dict[str, Any] = dict(
    family="qwen2", vocab_size=130, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
)
# Qwen3: an RMSNorm on every query and key head (q_norm / k_norm), untied.
QWEN3_QK_NORM: dict[str, Any] = dict(
    family="qwen3", vocab_size=150, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
)


def build_tiny_model(directory: str | Path, spec: dict[str, Any], seed: int = 0) -> Path:
    """Write a random model to `directory` (config.json + model.safetensors); returns the path."""
    import transformers

    spec = dict(spec)
    family = spec.pop("family")
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    config = config_class(max_position_embeddings=256, rms_norm_eps=1e-6, **spec)
    torch.manual_seed(seed)
    model = model_class(config)
    randomize(model, seed)
    directory = Path(directory)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.3 * noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)


def load_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(directory) / "model.safetensors"))


def load_config(directory: str | Path) -> dict[str, Any]:
    return json.loads((Path(directory) / "config.json").read_text())


def load_hf_model(directory: str | Path) -> torch.nn.Module:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    return model.eval()


def perturbed_state_dict(directory: str | Path, seed: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """The model's weights plus noise: 'the policy after a training step', clearly different."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor + scale * tensor.std() * torch.randn(tensor.shape, generator=generator)
        for name, tensor in load_state_dict(directory).items()
    }
