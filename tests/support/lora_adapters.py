"""LoRA adapters for the tests, under peft's names: random ones of a model's shape, the fused (type lora) form where a
megatron layer's projections share one A, and peft's gradients as such a fused adapter receives them. Shared by
tests/models/test_lora.py, tests/models/test_lora_moe.py, tests/reshard/test_adapter_sync.py and
tests/training/test_lora.py; `adapted_model_pass`: one rank's forward and backward of a model with adapters."""
from __future__ import annotations

from pathlib import Path
from typing import Any

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


def adapted_model_pass(rank: int, ctx: Any, hf_dir: str, settings: Any, state: dict[str, torch.Tensor] | None,
                       weights: torch.Tensor, tokens: torch.Tensor, vocab: int, *, export: str | None = None,
                       sequence_parallel: bool = False) -> tuple[dict[str, Any], list[Any]]:
    """In a forked rank whose megatron parallel state is up (`ctx`): the model of `hf_dir` with adapters (`settings`),
    set from `state` (peft names) when given and exported by rank 0 to `export`; its logits (gathered over TP) with
    and without them; after a backward of (logits x weights).sum(), every adapter's gradient as megatron's DDP and
    finalize_model_grads leave it: a routed expert's half summed over the expert data-parallel group, then a half
    tagged sequence-parallel summed over TP. The result (whole tensors under peft's names) and the adapters."""
    import torch.distributed as dist
    from megatron.core import parallel_state as megatron_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from hybridrl.models.bridge import build_gpt_model, load_weights
    from hybridrl.models.lora import adapters_disabled, add_lora, load_lora_state, lora_state, save_peft_adapter

    model = build_gpt_model(hf_dir, config_overrides={"sequence_parallel": sequence_parallel})
    load_weights([model], hf_dir)
    adapters = add_lora(model, settings)
    initial = lora_state(adapters)  # a collective: over each TP group (split halves) and EP group (experts)
    if state is not None:
        load_lora_state(adapters, state)
    whole = lora_state(adapters)
    if export is not None and rank == 0:
        save_peft_adapter(whole, settings, export, base_model=hf_dir)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad(), adapters_disabled([model]):
        base = gather_from_tensor_model_parallel_region(model(tokens, positions, None))[..., :vocab]
    logits = gather_from_tensor_model_parallel_region(model(tokens, positions, None))[..., :vocab]
    (logits * weights).sum().backward()
    for adapter in adapters:
        for param in (*adapter.lora_A, *adapter.lora_B):
            if getattr(param, "allreduce", True) is False:  # DDP's expert buckets
                dist.all_reduce(param.grad, group=megatron_state.get_expert_data_parallel_group())
            if getattr(param, "sequence_parallel", False):  # then finalize_model_grads, whatever DDP did
                dist.all_reduce(param.grad, group=ctx.tp_group)
    base_grads = [n for n, p in model.named_parameters() if p.grad is not None and "lora_" not in n]
    return {"logits": logits.detach(), "base": base, "grads": lora_state(adapters, grads=True), "initial": initial,
            "base_grads": base_grads}, adapters


def assert_plan_expects_the_folder(folder: Path, hf_dir: Path, kind: str, rank: int = RANK) -> None:
    """What `hybridrl plan` expects an `adapter_path` folder of these adapters to hold (`peft_tensor_shapes`, every
    target of `kind`) is exactly the folder the ranks exported: names and shapes, experts included."""
    from safetensors import safe_open

    from hybridrl.models.arch import ModelShape, read_hf_config
    from hybridrl.models.lora_targets import TARGETS, peft_tensor_shapes

    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as handle:
        held = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
    shape = ModelShape.from_hf_config(read_hf_config(hf_dir))
    assert peft_tensor_shapes(shape, kind, tuple(TARGETS[kind]), rank) == held
