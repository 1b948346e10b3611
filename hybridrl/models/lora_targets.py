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

from hybridrl.models.arch import ModelShape

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
# where peft keeps a projection's adapter on a Llama-like transformers model (`get_peft_model`), per layer
PEFT_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
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


def peft_name(layer: int, projection: str, half: str) -> str:
    """peft's state-dict name of one adapter half (`half`: "lora_A" or "lora_B") of a dense layer (a routed
    expert's: `LoraAdapter.peft_name`)."""
    return f"base_model.model.model.layers.{layer}.{PEFT_MODULE[projection]}.{projection}.{half}.weight"


def expert_hf_modules(shape: ModelShape, leaf: str, layer: int, expert: int) -> dict[str, str]:
    """The Hugging Face modules a routed expert's `leaf` holds, by projection, as the family's weight table names
    them (Qwen3-MoE: `model.layers.{i}.mlp.experts.{e}.gate_proj` and `up_proj`; Mixtral: `block_sparse_moe...w1`
    and `w3`)."""
    spec = next(s for s in shape.weights.layer if s.expert and s.megatron.endswith(f".{leaf}.weight"))
    names = [tensor.name.format(i=layer, e=expert).removesuffix(".weight") for tensor in spec.hf]
    return dict(zip(PROJECTIONS[leaf], names, strict=True))


def peft_tensor_shapes(shape: ModelShape, kind: str, targets: tuple[str, ...], rank: int
                       ) -> dict[str, tuple[int, int]]:
    """Every tensor of a PEFT adapter folder of these adapters on this model, by peft's name, with its shape (A
    `[r, in]`, B `[out, r]`): what `lora_state` exports and what `load_lora_state` reads. `(layer, projection)`
    groups for a fused (type lora) adapter's shared A: `fused_a_groups`."""
    adapted = adapted_projections(kind, targets)
    q, kv, hidden = shape.num_attention_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, shape.hidden_size
    out: dict[str, tuple[int, int]] = {}
    for layer in range(shape.num_layers):
        experts = shape.num_experts if layer in shape.moe_layers else 0
        ffn = shape.moe_ffn_hidden_size if experts else shape.ffn_hidden_size
        sizes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
                 "gate_proj": (ffn, hidden), "up_proj": (ffn, hidden), "down_proj": (hidden, ffn)}
        for leaf, projections in PROJECTIONS.items():
            for projection in projections:
                if projection not in adapted:
                    continue
                rows, inputs = sizes[projection]
                if experts and leaf in ("linear_fc1", "linear_fc2"):
                    prefixes = [f"base_model.model.{expert_hf_modules(shape, leaf, layer, e)[projection]}"
                                for e in range(experts)]
                else:
                    prefixes = [peft_name(layer, projection, "lora_A").removesuffix(".lora_A.weight")]
                for prefix in prefixes:
                    out[f"{prefix}.lora_A.weight"] = (rank, inputs)
                    out[f"{prefix}.lora_B.weight"] = (rows, rank)
    return out


def fused_a_groups(names: Mapping[str, object]) -> list[list[str]]:
    """The A tensors (by peft's name, among `names`) that one fused (type lora) adapter shares: each megatron layer's
    projections' (q, k, v; gate, up), two or more of them."""
    groups: list[list[str]] = []
    for projections in PROJECTIONS.values():
        first = projections[0]
        for name in names:
            if f".{first}.lora_A." in name:
                group = [name.replace(f".{first}.", f".{p}.") for p in projections]
                if len(group) > 1 and all(n in names for n in group):
                    groups.append(group)
    return groups


# PEFT adapter_config.json settings that change what an adapter computes, which hybridrl's adapters do not have:
# (key, the value hybridrl's adapters compute as, what the key does)
PEFT_UNBUILT: tuple[tuple[str, object, str], ...] = (
    ("use_rslora", False, "rsLoRA scales by lora_alpha / sqrt(r); hybridrl's adapters scale by alpha / rank"),
    ("use_dora", False, "DoRA adapts each weight's magnitude too (lora_magnitude_vector); hybridrl's adapters are "
                        "LoRA's"),
    ("rank_pattern", {}, "a rank per module; hybridrl's adapters have one rank"),
    ("alpha_pattern", {}, "an alpha per module; hybridrl's adapters have one alpha"),
    ("lora_bias", False, "a bias on each B; hybridrl's adapters have none"),
    ("modules_to_save", None, "whole modules trained beside the adapters; hybridrl trains the adapters alone"),
    ("trainable_token_indices", None, "trained embedding rows; hybridrl trains the adapters alone"),
    ("layer_replication", None, "layers repeated; hybridrl adapts the model's own layers"),
)


def peft_unbuilt_settings(saved: Mapping[str, object]) -> list[tuple[str, object, str]]:
    """(key, the adapter's value, why) for each adapter_config.json setting hybridrl's adapters do not compute: loaded
    as it stands the adapter would compute something else, silently. A peft_type other than LORA first."""
    if saved.get("peft_type", "LORA") != "LORA":
        return [("peft_type", saved.get("peft_type"), "hybridrl's adapters are LoRA's (peft_type LORA)")]
    out = []
    for key, plain, why in PEFT_UNBUILT:
        value = saved.get(key, plain)
        if value not in (plain, None, {}, [], False):
            out.append((key, value, why))
    return out


# vLLM's LoRAConfig.max_lora_rank takes these values only (vllm/config/lora.py, MaxLoRARanks): an engine serving
# adapters of rank r is built with the first one >= r
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds adapters of `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"vLLM serves adapters of rank <= {VLLM_LORA_RANKS[-1]}; this one has rank {rank}")
