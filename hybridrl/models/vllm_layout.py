"""The vLLM side of the weight tables: which HF ranges make each parameter vLLM holds on one
inference-TP rank (pure data, no torch, no vLLM import).

Derived from the family's weight table (`hybridrl/models/families/`): this module holds vLLM's rule
for each `Split` kind. The resharder must produce, on each rollout rank, byte for byte what vLLM's
own loader would put in that rank's parameters; `tests/reshard/test_layout.py` checks these
targets against real vLLM (parameters captured before the CPU weight repacking).

vLLM 0.32 rules (`vllm/model_executor/layers/linear.py`, `vocab_parallel_embedding.py`):
- VOCAB: padded to a multiple of 64 (`DEFAULT_VOCAB_PADDING_SIZE`, independent of TP) with zero
  rows, then split evenly on dim 0. With tied embeddings vLLM has one parameter, the embedding's.
- QKV: rank r holds `[q heads of r; k heads of r; v heads of r]`. When infer_tp > num KV heads each
  rank holds exactly one KV head, replicated on `infer_tp // num_kv_heads` consecutive ranks: KV
  head index `r // (infer_tp // num_kv_heads)`.
- ROW: split on dim 1; COLUMN: split on dim 0; FUSED_COLUMN: `[part r of each tensor]`.
- REPLICATED: a whole copy on every rank.
- MoE experts (`WeightSpec(expert=True)`; vLLM's default for TP, no `enable_expert_parallel`): every
  rank holds all experts of a layer stacked in one parameter, `experts.routed_experts.w13_weight`
  [E, 2 * I / tp, H] and `w2_weight` [E, H, I / tp] (`fused_moe/unquantized_fused_moe_method.py`,
  loaded by `routed_experts.py`'s `_load_w13` / `_load_w2`); each expert's slot follows the dense
  rule of its `Split` (w13: `[gate part r; up part r]`, w2: columns part r). Such a parameter is
  planned as one `TensorPlan` per expert slot, named `stacked_slot_name(param, e)`; the slots
  stacked on a new dim 0 are the parameter (`stacked_params`). On CPU vLLM pads the per-rank
  width to its kernel's alignment and prepacks both only after loading (the loaded layout is what
  is planned and compared, as for the repacked linear weights).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from math import prod
from typing import Any

from hybridrl.models.arch import ModelShape
from hybridrl.models.family import Split, WeightSpec
from hybridrl.models.layout import Segment, TensorPlan, hf_dims, split_axis, table_specs

# vLLM's `DEFAULT_VOCAB_PADDING_SIZE` (vocab_parallel_embedding.py): the padded vocab must also
# divide by infer_tp, which holds for every power-of-two TP up to 64.
VLLM_VOCAB_PADDING = 64


def vllm_padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


def shape_of(hf_config: Mapping[str, Any] | ModelShape) -> ModelShape:
    return hf_config if isinstance(hf_config, ModelShape) else ModelShape.from_hf_config(hf_config)


def check_infer_tp(shape: ModelShape, infer_tp: int, rank: int | None = None) -> None:
    """Raise ValueError when vLLM could not shard this model `infer_tp` ways."""
    problems = []
    if infer_tp < 1:
        problems.append(f"infer_tp={infer_tp} must be >= 1")
    else:
        if shape.num_attention_heads % infer_tp:
            problems.append(f"num_attention_heads={shape.num_attention_heads} is not divisible by infer_tp={infer_tp}")
        kv = shape.num_kv_heads
        if (kv >= infer_tp and kv % infer_tp) or (kv < infer_tp and infer_tp % kv):
            problems.append(f"num_key_value_heads={kv} and infer_tp={infer_tp}: one must divide the other")
        if shape.is_moe and shape.moe_ffn_hidden_size % infer_tp:
            problems.append(f"the experts' intermediate size {shape.moe_ffn_hidden_size} is not divisible by "
                            f"infer_tp={infer_tp}")
        dense_mlp = not shape.is_moe or len(shape.moe_layers) < shape.num_layers
        if dense_mlp and shape.ffn_hidden_size % infer_tp:
            problems.append(f"intermediate_size={shape.ffn_hidden_size} is not divisible by infer_tp={infer_tp}")
        if vllm_padded_vocab(shape.vocab_size) % infer_tp:
            padded = vllm_padded_vocab(shape.vocab_size)
            problems.append(f"padded vocab {padded} is not divisible by infer_tp={infer_tp}")
        if rank is not None and not 0 <= rank < infer_tp:
            problems.append(f"rank={rank} is outside [0, {infer_tp})")
    if problems:
        raise ValueError("; ".join(problems))


def kv_head_range(shape: ModelShape, infer_tp: int, rank: int) -> tuple[int, int]:
    """[first, stop) KV heads vLLM's rank `rank` holds."""
    kv = shape.num_kv_heads
    if infer_tp <= kv:
        per_rank = kv // infer_tp
        return rank * per_rank, (rank + 1) * per_rank
    replicas = infer_tp // kv
    head = rank // replicas
    return head, head + 1


def _even_part(name: str, size: int, infer_tp: int, rank: int) -> Segment:
    part = size // infer_tp
    return Segment(name, rank * part, (rank + 1) * part)


def _vocab_segments(shape: ModelShape, hf_name: str, infer_tp: int, rank: int) -> tuple[Segment, ...]:
    rows = vllm_padded_vocab(shape.vocab_size) // infer_tp
    start, stop = rank * rows, (rank + 1) * rows
    real_stop = min(stop, shape.vocab_size)
    out = []
    if real_stop > start:
        out.append(Segment(hf_name, start, real_stop))
    pad = stop - max(start, real_stop)
    if pad:
        out.append(Segment(None, 0, pad))
    return tuple(out)


def _vllm_segments(shape: ModelShape, spec: WeightSpec, layer: int | None, infer_tp: int, rank: int,
                   expert: int | None = None) -> tuple[Segment, ...]:
    names = [t.at(layer, expert) for t in spec.hf]
    if spec.split is Split.REPLICATED:
        return (Segment(names[0], 0, prod(hf_dims(shape, spec.hf[0]))),)
    if spec.split is Split.VOCAB:
        return _vocab_segments(shape, names[0], infer_tp, rank)
    if spec.split is Split.QKV:
        d = shape.head_dim
        kv_first, kv_stop = kv_head_range(shape, infer_tp, rank)
        q, k, v = names
        return (_even_part(q, shape.q_size, infer_tp, rank),
                Segment(k, kv_first * d, kv_stop * d), Segment(v, kv_first * d, kv_stop * d))
    axis = split_axis(spec.split)
    assert axis is not None
    return tuple(_even_part(name, hf_dims(shape, t)[axis], infer_tp, rank) for name, t in zip(names, spec.hf))


def vllm_targets(hf_config: Mapping[str, Any] | ModelShape, infer_tp: int, rank: int) -> dict[str, TensorPlan]:
    """Every vLLM tensor of generation TP rank `rank`, in table order, as HF ranges."""
    shape = shape_of(hf_config)
    check_infer_tp(shape, infer_tp, rank)
    out: dict[str, TensorPlan] = {}
    for spec, layer, expert in table_specs(shape):
        name = spec.vllm if layer is None else spec.vllm.format(i=layer)
        if expert is not None:  # one slot of the layer's stacked expert parameter
            name = stacked_slot_name(name, expert)
        segments = _vllm_segments(shape, spec, layer, infer_tp, rank, expert)
        axis = split_axis(spec.split)
        dims = list(hf_dims(shape, spec.hf[0]))
        if axis is not None:
            dims[axis] = sum(s.length for s in segments)
        out[name] = TensorPlan(name, tuple(dims), axis, segments)
    return out


_SLOT = re.compile(r"^(?P<param>.+)\[(?P<slot>\d+)\]$")


def stacked_slot_name(param: str, slot: int) -> str:
    """The planning name of slot `slot` (an expert) of the stacked vLLM parameter `param`."""
    return f"{param}[{slot}]"


def split_slot_name(name: str) -> tuple[str, int | None]:
    """(vLLM parameter, slot) of a planning name; slot None for a parameter planned whole."""
    found = _SLOT.match(name)
    return (name, None) if found is None else (found["param"], int(found["slot"]))


def stacked_params(names: Any) -> dict[str, list[str]]:
    """vLLM parameter -> its planning names in order (one name for an unstacked parameter)."""
    out: dict[str, list[str]] = {}
    for name in names:
        out.setdefault(split_slot_name(name)[0], []).append(name)
    return out


def vllm_param_shapes(
    hf_config: Mapping[str, Any] | ModelShape, infer_tp: int, rank: int = 0
) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter vLLM holds on `rank` (same for every rank of a TP group);
    a stacked expert parameter is [experts, *slot shape]."""
    targets = vllm_targets(hf_config, infer_tp, rank)
    out = {}
    for param, names in stacked_params(targets).items():
        first = targets[names[0]].shape
        out[param] = first if split_slot_name(names[0])[1] is None else (len(names), *first)
    return out
