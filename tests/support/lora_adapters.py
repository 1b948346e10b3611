"""LoRA adapters for the tests, under peft's names: random ones of a model's shape, the fused (type lora) form where a
megatron layer's projections share one A, and peft's gradients as such a fused adapter receives them. Shared by
tests/models/test_lora.py, tests/reshard/test_adapter_sync.py and tests/training/test_lora.py."""
from __future__ import annotations

from pathlib import Path

import torch

from hybridrl.models.lora_targets import PROJECTIONS as LAYER_PROJECTIONS

RANK = 4  # the tests' adapter rank


def adapter_state(hf_dir: Path, seed: int, rank: int = RANK) -> dict[str, torch.Tensor]:
    """Random adapters of the model's shape under peft's names (B not zero: the adapters change the model)."""
    from tests.support.models_fixtures import read_json

    c = read_json(hf_dir / "config.json")
    hidden, heads, kv, ffn = (c[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                             "intermediate_size"))
    head_dim = c.get("head_dim") or hidden // heads
    sizes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv * head_dim, hidden),
             "v_proj": (kv * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
             "gate_proj": (ffn, hidden), "up_proj": (ffn, hidden), "down_proj": (hidden, ffn)}
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for layer in range(c["num_hidden_layers"]):
        for projection, (out, inp) in sizes.items():
            module = "self_attn" if projection in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{module}.{projection}"
            state[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) * 0.2
            state[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.2
    return state


def shared_a(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with the projections of each megatron layer sharing the first one's A: a fused (type lora) adapter."""
    shared = dict(state)
    for name in state:
        for projections in LAYER_PROJECTIONS.values():
            for other in projections[1:]:
                if f".{other}.lora_A." in name:
                    shared[name] = state[name.replace(other, projections[0])]
    return shared


def fused_grads(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft's gradients as a fused adapter gets them: one A for the layer's projections, so its gradient is their
    A gradients' sum (each projection's name showing it); B's rows each their projection's."""
    fused = dict(grads)
    for name in grads:
        for projections in LAYER_PROJECTIONS.values():
            if ".lora_A." in name and f".{projections[0]}." in name:
                total = sum(grads[name.replace(projections[0], p)] for p in projections)
                for p in projections:
                    fused[name.replace(projections[0], p)] = total
    return fused
