"""What a LoRA adapter can be put on, in verl's (Megatron-Bridge's) words; torch-free, so the config reads it too.

Two kinds of adapter (verl's `actor_rollout_ref.model.lora.type`):
- `lora`: one adapter per megatron layer. The fused `linear_qkv` gets one A and one B whose rows are the
  layer's (q, k and v of every query group), `linear_fc1` one for gate and up together. Exported to PEFT as one
  adapter per Hugging Face projection sharing that A (exact: each projection's rows of B A).
- `canonical_lora`: one adapter per Hugging Face projection (q, k, v, gate and up each their own A), as peft puts
  them on the transformers model.
"""
from __future__ import annotations

from collections.abc import Mapping

# megatron's layers -> the Hugging Face projections they hold, in their output order
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
ROW_PARALLEL = frozenset({"linear_proj", "linear_fc2"})

# type -> its target names -> the Hugging Face projections each one adapts
TARGETS: dict[str, dict[str, tuple[str, ...]]] = {
    "lora": dict(PROJECTIONS),
    "canonical_lora": {"linear_q": ("q_proj",), "linear_k": ("k_proj",), "linear_v": ("v_proj",),
                       "linear_proj": ("o_proj",), "linear_fc1_gate": ("gate_proj",),
                       "linear_fc1_up": ("up_proj",), "linear_fc2": ("down_proj",)},
}
LORA_TYPES = tuple(TARGETS)
A_INIT_METHODS = ("xavier", "kaiming")  # Megatron-Bridge's: xavier_uniform_, kaiming_uniform_(a=sqrt(5))


def adapted_projections(kind: str, targets: tuple[str, ...]) -> frozenset[str]:
    """The Hugging Face projections the targets of a `kind` adapt."""
    return frozenset(p for target in targets for p in TARGETS[kind][target])


def adapter_elements_per_layer(kind: str, targets: tuple[str, ...], rank: int, *, hidden: int, q_rows: int,
                               kv_rows: int, ffn: int, tp: int = 1, peft_form: bool = False, experts: int = 0,
                               expert_tp: int = 1) -> int:
    """One decoder layer's adapter elements on one TP rank (a column-parallel layer's A whole on each rank and B
    split; a row-parallel layer's A split and B whole), as `hybridrl.models.lora` builds them; `peft_form`: as a
    PEFT folder holds them (an A per projection, a fused adapter's shared A repeated). `experts` > 0: an MoE layer
    whose MLP is that many experts of `ffn` on this rank with adapters of their own, each expert split over
    `expert_tp` ranks as the dense layers are over TP."""
    adapted = adapted_projections(kind, targets)
    rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows, "o_proj": hidden, "gate_proj": ffn,
            "up_proj": ffn, "down_proj": hidden}
    inputs = {"linear_qkv": hidden, "linear_proj": q_rows, "linear_fc1": hidden, "linear_fc2": ffn}
    total = 0
    for module, projections in PROJECTIONS.items():
        mine = [p for p in projections if p in adapted]
        if not mine:
            continue
        expert_mlp = experts > 0 and module in ("linear_fc1", "linear_fc2")
        split, copies = (expert_tp, experts) if expert_mlp else (tp, 1)
        parts = 1 if kind == "lora" and not peft_form else len(mine)
        if module in ROW_PARALLEL:
            total += copies * (parts * rank * inputs[module] // split + sum(rows[p] for p in mine) * rank)
        else:
            total += copies * (parts * rank * inputs[module] + sum(rows[p] for p in mine) * rank // split)
    return total


def peft_config_mismatches(saved: Mapping[str, object], rank: int, alpha: float) -> list[tuple[str, str, object]]:
    """(our field, PEFT key, the adapter's value) where a PEFT adapter_config.json's rank or alpha differs from
    ours: loading it as it stands would rescale every adapter silently."""
    return [(name, key, saved.get(key)) for key, ours, name in (("r", rank, "rank"), ("lora_alpha", alpha, "alpha"))
            if saved.get(key) != ours]


# vLLM's LoRAConfig.max_lora_rank takes these values only (vllm/config/lora.py, MaxLoRARanks): an engine serving
# adapters of rank r is built with the first one >= r
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds adapters of `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"vLLM serves adapters of rank <= {VLLM_LORA_RANKS[-1]}; this one has rank {rank}")
