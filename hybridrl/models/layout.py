"""HF ⇄ megatron weight layout as pure data: which HF rows/columns make each megatron shard.

Derived from the family's weight table (`hybridrl/models/families/`, vocabulary in
`models/family.py`): this module holds the megatron rule for each `Split` kind, nothing per family.

No torch here. Every megatron tensor of a (TP rank, PP stage, VPP chunk) is described as a
`TensorPlan`: an ordered list of `Segment`s, each a contiguous range of one HF tensor along the
plan's `axis` (or zero padding), concatenated in order. Loading reads exactly those ranges
(`safetensors` `get_slice`), exporting writes each shard's pieces back to the same ranges; so the
two directions are one description and cannot disagree.

Megatron layouts encoded here (megatron-core 0.16.1, local and TE GPT layer specs):
- `linear_qkv`: rows grouped per query group `[q heads of group g; k_g; v_g]` for g in order,
  and that whole fused order is split into `tp` contiguous chunks. When tp > num KV heads a chunk
  is a part of one group; megatron all-gathers the fused output and picks its group, so the
  weight is still split exactly once (no replicated KV copies that could drift apart in training).
- `linear_fc1`: each TP rank holds `[gate shard r; up shard r]` (not a split of `[gate; up]`).
- `linear_proj`, `linear_fc2` (row-parallel): split on dim 1.
- embedding / output layer: vocab padded to `divisor * tp` rows with zeros, split on dim 0.
- norms (and Qwen3's per-head q/k norms): replicated on every TP rank.
- MoE (local spec, SequentialMLP): the router `mlp.router.weight` whole on every rank; expert e of
  a layer lives on EP rank e // (experts / ep) as `mlp.experts.local_experts.{e mod experts/ep}`,
  its fc1/fc2 split over the expert TP size (`etp`, TP by default) like the dense MLP's over TP.
  megatron lays two meshes over the same ranks: on local rank i of a pipeline stage the dense one
  puts TP rank i % tp, the expert one (its expert rank generator, etp-ep-edp) expert TP rank i % etp
  and EP rank (i // etp) % ep. The pair repeats every lcm(tp, etp * ep) ranks, so a stage has that
  many distinct tensor sets, its slots (`ParallelLayout.slots`); a rank file is per slot and PP
  stage: (TP, PP, EP) with ETP = TP, (TP, PP, EP, ETP) otherwise. Slot s holds dense tensors of TP
  rank s % tp, copies from slot tp on, and experts of (s % etp, (s // etp) % ep), copies from slot
  etp * ep on.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from math import prod
from typing import Any, NamedTuple

from hybridrl.models.arch import ModelShape, ParallelLayoutError
from hybridrl.models.family import HFTensor, Split, WeightSpec


@dataclass(frozen=True)
class Segment:
    """Range [start, stop) of HF tensor `hf_name` along the plan's axis; `hf_name=None` is zero padding."""

    hf_name: str | None
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of one rank (a megatron shard, or a vLLM parameter in `models.vllm_layout`):
    `segments` concatenated along `axis` (None: a whole copy)."""

    name: str
    shape: tuple[int, ...]
    axis: int | None
    segments: tuple[Segment, ...]
    # A replicated tensor (norm) or the duplicate of a tied embedding on the last stage: exports
    # take the value from one holder, so these copies are skipped when reassembling HF tensors.
    is_copy: bool = False
    # A routed expert's weight (split over the expert TP ranks, placed by EP) rather than a dense one.
    expert: bool = False

    @property
    def hf_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.hf_name for s in self.segments if s.hf_name is not None))

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def padding_numel(self) -> int:
        """Elements of zero padding (vocab rows): written, never moved."""
        if self.axis is None:
            return 0
        per_position = self.numel // self.shape[self.axis]
        return sum(seg.length for seg in self.segments if seg.hf_name is None) * per_position


@dataclass(frozen=True)
class StageChunk:
    """A model chunk: the layers one GPTModel instance of one PP rank (and VPP stage) owns."""

    pp_rank: int
    vp_stage: int | None
    first_layer: int
    num_layers: int
    pre_process: bool
    post_process: bool

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)


class ModelRank(NamedTuple):
    """A rank file's position: one slot of one pipeline stage (`ParallelLayout.model_ranks`)."""

    tp_rank: int
    pp_rank: int
    ep_rank: int
    etp_rank: int


@dataclass(frozen=True)
class ParallelLayout:
    """TP/PP/VPP/EP/ETP sizes of a sharded model and how its layers split over the PP stages (EP, ETP:
    MoE experts; `etp` None is TP). `first_stage_layers` / `last_stage_layers` are megatron's
    `num_layers_in_first_pipeline_stage` / `num_layers_in_last_pipeline_stage`: None gives that stage
    the even share of what the set ones leave; both None is megatron's even split."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    etp: int | None = None

    def __post_init__(self) -> None:
        if self.vpp == 1:
            object.__setattr__(self, "vpp", None)
        if self.etp == self.tp:  # one spelling per layout: equal layouts compare equal
            object.__setattr__(self, "etp", None)

    @property
    def uneven(self) -> bool:
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size: each expert's fc1/fc2 split over this many ranks."""
        return self.etp or self.tp

    @property
    def slots(self) -> int:
        """Distinct tensor sets of one pipeline stage (the module docstring): lcm(tp, etp * ep)."""
        return math.lcm(self.tp, self.expert_tp * self.ep)

    def slot_ranks(self, slot: int) -> tuple[int, int, int]:
        """(tp_rank, ep_rank, etp_rank) of local rank `slot` of a stage (any local rank: mod slots)."""
        return slot % self.tp, (slot // self.expert_tp) % self.ep, slot % self.expert_tp

    def slot_of(self, tp_rank: int, ep_rank: int = 0, etp_rank: int | None = None) -> int:
        """The slot of a stage holding TP rank `tp_rank`, EP rank `ep_rank` and expert TP rank `etp_rank`
        (None: tp_rank % etp, which is tp_rank when ETP = TP); an error for a combination no rank has."""
        if not (0 <= tp_rank < self.tp and 0 <= ep_rank < self.ep):
            raise ParallelLayoutError(f"tp_rank={tp_rank}, ep_rank={ep_rank} outside tp={self.tp}, ep={self.ep}")
        etp_rank = tp_rank % self.expert_tp if etp_rank is None else etp_rank
        for slot in range(self.slots):
            if self.slot_ranks(slot) == (tp_rank, ep_rank, etp_rank):
                return slot
        raise ParallelLayoutError(f"no rank holds tp_rank={tp_rank} with ep_rank={ep_rank}, etp_rank={etp_rank} "
                                  f"(tp={self.tp}, ep={self.ep}, etp={self.expert_tp}: megatron's expert mesh "
                                  "places them on different ranks)")

    def model_ranks(self) -> Iterator[ModelRank]:
        """Every rank file's position: each slot of each stage (with ETP = TP, (tp, ep) with tp fastest)."""
        for pp_rank in range(self.pp):
            for slot in range(self.slots):
                tp_rank, ep_rank, etp_rank = self.slot_ranks(slot)
                yield ModelRank(tp_rank, pp_rank, ep_rank, etp_rank)

    @property
    def num_chunks_per_stage(self) -> int:
        return self.vpp or 1

    def split_errors(self, num_layers: int,
                     names: tuple[str, str] = ("first_stage_layers", "last_stage_layers")) -> list[str]:
        """Every reason `num_layers` cannot be split over the PP stages this way (megatron-core 0.16.1's
        TransformerConfig rules; empty when it can). `names`: what the messages call the two counts
        (the config says num_layers_in_first_pipeline_stage / ..._last_...)."""
        vpp = self.num_chunks_per_stage
        if not self.uneven:
            if num_layers % (self.pp * vpp):
                return [f"num_hidden_layers={num_layers} is not divisible by pp*vpp={self.pp * vpp} "
                        "(an even split; first_stage_layers / last_stage_layers set an uneven one)"]
            return []
        if self.pp < 2:
            return [f"{names[0]} / {names[1]} need pp >= 2 (got pp={self.pp})"]
        errors = []
        middle_layers, middle_stages = num_layers, self.pp
        for label, count in zip(names, (self.first_stage_layers, self.last_stage_layers)):
            if count is None:
                continue
            middle_layers, middle_stages = middle_layers - count, middle_stages - 1
            if count < 1:
                errors.append(f"{label}={count} must be >= 1")
            elif count % vpp:
                errors.append(f"{label}={count} is not divisible by vpp={vpp}")
        if errors:
            return errors
        split = f"{names[0]}={self.first_stage_layers}, {names[1]}={self.last_stage_layers}"
        if middle_stages == 0:
            if middle_layers:
                errors.append(f"{split} must add up to the {num_layers} layers at pp={self.pp}")
            elif self.vpp:
                # megatron-core 0.16.1 get_transformer_layer_offset divides by the middle stage count
                errors.append(f"{split} with vpp={self.vpp} needs a middle stage (pp >= 3), or only one of them set")
        elif middle_layers < middle_stages:
            errors.append(f"{split} leave {middle_layers} of the {num_layers} layers for {middle_stages} more "
                          "stage(s): every stage needs at least 1")
        elif middle_layers % (middle_stages * vpp):
            errors.append(f"{split} leave {middle_layers} layers, not divisible by the other {middle_stages} "
                          f"stage(s)" + (f" × vpp={vpp}" if self.vpp else ""))
        return errors

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Decoder layers of each PP stage, in stage order (all its VPP chunks together)."""
        errors = self.split_errors(num_layers)
        if errors:
            raise ParallelLayoutError("; ".join(errors))
        first, last = self.first_stage_layers, self.last_stage_layers
        set_ = [c for c in (first, last) if c is not None]
        middle_stages = self.pp - len(set_)
        per_stage = (num_layers - sum(set_)) // middle_stages if middle_stages else 0
        counts = [per_stage] * self.pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return tuple(counts)

    def chunks(self, num_layers: int, pp_rank: int) -> list[StageChunk]:
        """The chunks `pp_rank` owns, in vp_stage order: megatron's `get_transformer_layer_offset` and
        `get_num_layers_to_build`, even or uneven. Each VPP round v holds num_layers / vpp layers, a
        stage's chunk in it is that stage's layers / vpp, after the earlier stages' chunks."""
        if not 0 <= pp_rank < self.pp:
            raise ParallelLayoutError(f"pp_rank={pp_rank} outside pp={self.pp}")
        vpp = self.num_chunks_per_stage
        per_chunk = [count // vpp for count in self.stage_layers(num_layers)]
        out = []
        for v in range(vpp):
            out.append(StageChunk(
                pp_rank=pp_rank,
                vp_stage=v if self.vpp else None,
                first_layer=v * (num_layers // vpp) + sum(per_chunk[:pp_rank]),
                num_layers=per_chunk[pp_rank],
                pre_process=pp_rank == 0 and v == 0,
                post_process=pp_rank == self.pp - 1 and v == vpp - 1,
            ))
        return out

    def all_chunks(self, num_layers: int) -> list[StageChunk]:
        return [c for p in range(self.pp) for c in self.chunks(num_layers, p)]

    def owner_of_layer(self, num_layers: int, layer: int) -> tuple[StageChunk, int]:
        """(chunk, local index inside that chunk) of global decoder layer `layer`."""
        for chunk in self.all_chunks(num_layers):
            if layer in chunk.layers:
                return chunk, layer - chunk.first_layer
        raise ParallelLayoutError(f"layer {layer} outside 0..{num_layers - 1}")

    def sizes(self) -> dict[str, int | None]:
        """Every field, as keyword arguments (`ModelShape.check_parallel(**layout.sizes())`)."""
        return {"tp": self.tp, "pp": self.pp, "vpp": self.vpp, "ep": self.ep,
                "first_stage_layers": self.first_stage_layers, "last_stage_layers": self.last_stage_layers,
                "etp": self.etp}

    def to_dict(self) -> dict[str, int | None]:
        # ep, etp and an uneven split only when used: other checkpoints' metadata stays what it was
        optional = {"first_stage_layers": self.first_stage_layers, "last_stage_layers": self.last_stage_layers,
                    "etp": self.etp}
        return ({"tp": self.tp, "pp": self.pp, "vpp": self.vpp} | ({"ep": self.ep} if self.ep > 1 else {})
                | {k: v for k, v in optional.items() if v is not None})

    @classmethod
    def of_context(cls, ctx: Any) -> ParallelLayout:
        """The layout of a `ParallelContext` (megatron's parallel state plus the stage split)."""
        return cls(tp=ctx.tp, pp=ctx.pp, vpp=ctx.vpp, ep=getattr(ctx, "ep", 1),
                   first_stage_layers=getattr(ctx, "first_stage_layers", None),
                   last_stage_layers=getattr(ctx, "last_stage_layers", None), etp=getattr(ctx, "etp", None))


def rank_chunk_key_prefix(layout: ParallelLayout, vp_stage: int | None) -> str:
    """Key prefix of a chunk inside a rank's checkpoint file: '' without VPP, 'model{v}.' with it."""
    return "" if vp_stage is None or layout.vpp is None else f"model{vp_stage}."


def checkpoint_file_name(tp_rank: int, pp_rank: int, ep_rank: int | None = None, etp_rank: int | None = None) -> str:
    """A rank file's name; `ep_rank` only for a layout with ep > 1 or an expert TP other than TP,
    `etp_rank` only for the latter (`rank_file_name`)."""
    ep = "" if ep_rank is None else f"_ep{ep_rank:03d}"
    etp = "" if etp_rank is None else f"_etp{etp_rank:02d}"
    return f"model_tp{tp_rank:02d}_pp{pp_rank:03d}{ep}{etp}.safetensors"


def rank_file_name(layout: ParallelLayout, tp_rank: int, pp_rank: int, ep_rank: int = 0,
                   etp_rank: int | None = None) -> str:
    """The rank file of that slot (`etp_rank` None: tp_rank % etp); validated against the layout."""
    slot = layout.slot_of(tp_rank, ep_rank, etp_rank)
    _, _, etp_rank = layout.slot_ranks(slot)
    if layout.etp is not None:
        return checkpoint_file_name(tp_rank, pp_rank, ep_rank, etp_rank)
    return checkpoint_file_name(tp_rank, pp_rank, ep_rank if layout.ep > 1 else None)


def holder_slot(layout: ParallelLayout, slot: int, expert: bool) -> int:
    """The slot whose rank file holds, not as a copy, the tensors slot `slot` holds: a dense tensor's
    first holder with the same TP rank (slot % tp), an expert's with the same EP and expert TP rank
    (slot % (etp * ep)). Replicated norms and a tied output layer stay copies there too."""
    return slot % (layout.expert_tp * layout.ep if expert else layout.tp)


def rank_file_fields(layout: ParallelLayout, rank: ModelRank) -> dict[str, int]:
    """What a checkpoint's metadata records about a rank file's position (EP, ETP only when used)."""
    return ({"tp_rank": rank.tp_rank, "pp_rank": rank.pp_rank}
            | ({"ep_rank": rank.ep_rank} if layout.ep > 1 else {})
            | ({"etp_rank": rank.etp_rank} if layout.etp is not None else {}))


# ---- segment arithmetic ---------------------------------------------------------------------------

def _take(full: list[Segment], start: int, stop: int) -> tuple[Segment, ...]:
    """The part of the concatenation `full` covering positions [start, stop)."""
    out: list[Segment] = []
    pos = 0
    for seg in full:
        lo, hi = max(start, pos), min(stop, pos + seg.length)
        if lo < hi:
            out.append(Segment(seg.hf_name, seg.start + lo - pos, seg.start + hi - pos))
        pos += seg.length
    if sum(s.length for s in out) != stop - start:
        raise ParallelLayoutError(f"range [{start}, {stop}) exceeds the concatenation length {pos}")
    return tuple(out)


def _tp_chunk(full: list[Segment], tp_rank: int, tp_size: int) -> tuple[Segment, ...]:
    total = sum(s.length for s in full)
    if total % tp_size:
        raise ParallelLayoutError(f"size {total} is not divisible by tp={tp_size}")
    part = total // tp_size
    return _take(full, tp_rank * part, (tp_rank + 1) * part)


def fused_qkv_order(shape: ModelShape, layer: int, kind: str = "weight") -> list[Segment]:
    """Megatron's full (unsharded) fused qkv rows: per query group [q heads; k head; v head]."""
    spec = next(s for s in shape.weights.layer if s.split is Split.QKV and s.hf[0].name.endswith(kind))
    return _grouped_qkv(shape, *(t.at(layer) for t in spec.hf))


def _grouped_qkv(shape: ModelShape, q: str, k: str, v: str) -> list[Segment]:
    q_rows = shape.heads_per_group * shape.head_dim
    d = shape.head_dim
    order: list[Segment] = []
    for g in range(shape.num_kv_heads):
        order.append(Segment(q, g * q_rows, (g + 1) * q_rows))
        order.append(Segment(k, g * d, (g + 1) * d))
        order.append(Segment(v, g * d, (g + 1) * d))
    return order


def vocab_order(shape: ModelShape, hf_name: str, tp_size: int) -> list[Segment]:
    padded = shape.padded_vocab_size(tp_size)
    order = [Segment(hf_name, 0, shape.vocab_size)]
    if padded > shape.vocab_size:
        order.append(Segment(None, 0, padded - shape.vocab_size))
    return order


def vocab_range_for_rank(shape: ModelShape, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, stop) of the real (unpadded) token ids whose logits TP rank `tp_rank` computes.

    Padded ids have zero output rows, i.e. logit 0: mask them (e.g. to -inf) before any softmax
    over the vocab-parallel logits, or they shift log-probs.
    """
    per_rank = shape.padded_vocab_size(tp_size) // tp_size
    lo = tp_rank * per_rank
    return min(lo, shape.vocab_size), min(lo + per_rank, shape.vocab_size)


# ---- the weight table, walked -----------------------------------------------------------------

def table_specs(shape: ModelShape) -> Iterator[tuple[WeightSpec, int | None, int | None]]:
    """Every logical weight this model has, in order, with its global layer (None outside the
    layers) and, for an MoE expert's weight, its global expert index (else None)."""
    table = shape.weights
    yield table.embedding, None, None
    for layer in range(shape.num_layers):
        for spec in table.layer:
            if not spec.exists(shape, layer):
                continue
            if spec.expert:
                for expert in range(shape.num_experts):
                    yield spec, layer, expert
            else:
                yield spec, layer, None
    yield table.final_norm, None, None
    if not shape.tie_word_embeddings:
        yield table.lm_head, None, None


def hf_dims(shape: ModelShape, tensor: HFTensor) -> tuple[int, ...]:
    return tuple(shape.dim(d) for d in tensor.dims)


def split_axis(split: Split) -> int | None:
    """The axis a split kind cuts (None: replicated), the same on the megatron and vLLM side."""
    return {Split.REPLICATED: None, Split.ROW: 1}.get(split, 0)


# ---- the HF side ----------------------------------------------------------------------------------

def hf_tensor_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this model holds, with its shape, in HF's usual order."""
    return {t.at(layer, expert): hf_dims(shape, t) for spec, layer, expert in table_specs(shape) for t in spec.hf}


# What a folder of pickled weights (pytorch_model*.bin) is told: unpickling runs code, so only safetensors
# are read; transformers re-saves the same weights as safetensors (its loader reads .bin with torch's
# weights_only unpickler).
PICKLED_WEIGHTS_HINT = ("only safetensors are supported (a .bin is a pickle, which can run code when read); "
                        "re-save the weights as safetensors with transformers: python -c \"import transformers; "
                        "transformers.AutoModelForCausalLM.from_pretrained('DIR').save_pretrained('DIR')\"")


# Tensors an HF checkpoint may carry that hold no weights (buffers saved by old transformers).
IGNORED_HF_SUFFIXES: tuple[str, ...] = (".rotary_emb.inv_freq",)


def hf_tensor_problems(shape: ModelShape, found: Mapping[str, tuple[tuple[int, ...], str]], *,
                       head: bool = True) -> list[str]:
    """How an HF checkpoint's tensors (name -> (shape, file name)) differ from what its config.json implies: missing
    tensors, wrong shapes, tensors it should not hold. `head=False` (a value model: critic, reward model): the output
    layer and any classifier head are the worker's own, so only the backbone is compared. Torch-free: the plan
    checks the safetensors headers with it, `HFCheckpointReader` the files it opened."""
    expected = hf_tensor_shapes(shape)
    lm_head = shape.weights.lm_head.hf_name
    if not head:
        expected.pop(lm_head, None)
    problems: list[str] = []
    missing = [name for name in expected if name not in found]
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {', '.join(missing[:8])}" + (" ..." if len(missing) > 8
                                                                                          else ""))
    for name, (got, file) in found.items():
        if name in expected:
            if tuple(got) != expected[name]:
                problems.append(f"{name} in {file} has shape {list(got)}, config implies {list(expected[name])}")
        elif head and shape.tie_word_embeddings and name == lm_head:
            continue  # some tied checkpoints still store lm_head; HF ignores it too
        elif head and not name.endswith(IGNORED_HF_SUFFIXES):
            problems.append(f"unexpected tensor {name} in {file}")
    return problems


@lru_cache(maxsize=64)
def _hf_axes(shape: ModelShape) -> dict[str, int | None]:
    return {t.at(layer, expert): split_axis(spec.split)
            for spec, layer, expert in table_specs(shape) for t in spec.hf}


def hf_tensor_axis(shape: ModelShape, hf_name: str) -> int | None:
    """The axis along which megatron splits this HF tensor (None: replicated), for slice reads."""
    try:
        return _hf_axes(shape)[hf_name]
    except KeyError:
        raise KeyError(f"{hf_name!r} is not a weight of this {shape.architecture}") from None


# ---- the megatron side ----------------------------------------------------------------------------

def _megatron_full_order(shape: ModelShape, spec: WeightSpec, layer: int | None, tp: int,
                         expert: int | None = None) -> list[Segment]:
    """The unsharded megatron parameter along its split axis (FUSED_COLUMN is split per tensor instead)."""
    names = [t.at(layer, expert) for t in spec.hf]
    if spec.split is Split.QKV:
        return _grouped_qkv(shape, *names)
    if spec.split is Split.VOCAB:
        return vocab_order(shape, names[0], tp)
    axis = split_axis(spec.split) or 0
    return [Segment(name, 0, hf_dims(shape, t)[axis]) for name, t in zip(names, spec.hf)]


def megatron_tensor_plan(
    shape: ModelShape, spec: WeightSpec, layer: int | None, local_name: str, tp: int, tp_rank: int,
    expert: int | None = None,
) -> TensorPlan:
    """The megatron parameter of one logical weight on TP rank `tp_rank` (of expert `expert`, global
    index, for an expert's weight)."""
    dims = hf_dims(shape, spec.hf[0])
    if spec.split is Split.REPLICATED:
        return TensorPlan(local_name, dims, None, (Segment(spec.hf[0].at(layer, expert), 0, prod(dims)),),
                          is_copy=tp_rank > 0)
    axis = split_axis(spec.split)
    assert axis is not None
    if spec.split is Split.FUSED_COLUMN:  # [part r of each tensor], not a split of their concatenation
        segs = tuple(seg for t in spec.hf
                     for seg in _tp_chunk([Segment(t.at(layer, expert), 0, hf_dims(shape, t)[0])], tp_rank, tp))
    else:
        segs = _tp_chunk(_megatron_full_order(shape, spec, layer, tp, expert), tp_rank, tp)
    shard = list(dims)
    shard[axis] = sum(s.length for s in segs)
    return TensorPlan(local_name, tuple(shard), axis, segs)


def chunk_tensor_plans(
    shape: ModelShape, layout: ParallelLayout, chunk: StageChunk, tp_rank: int, ep_rank: int = 0,
    etp_rank: int | None = None,
) -> list[TensorPlan]:
    """Plans for every tensor in the `state_dict()` of one GPTModel chunk (local spec names) on
    TP rank `tp_rank`, expert-parallel rank `ep_rank` and expert TP rank `etp_rank` (None:
    tp_rank % etp). Tensors another slot of the stage holds too are copies (module docstring)."""
    tp = layout.tp
    slot = layout.slot_of(tp_rank, ep_rank, etp_rank)
    _, _, etp_rank = layout.slot_ranks(slot)
    table = shape.weights
    plans: list[TensorPlan] = []
    per_rank = shape.experts_per_rank(layout.ep)

    def add(spec: WeightSpec, layer: int | None, local_name: str, expert: int | None = None) -> None:
        if spec.expert:  # split over the expert TP ranks; slots from etp * ep on repeat earlier ones
            plan = megatron_tensor_plan(shape, spec, layer, local_name, layout.expert_tp, etp_rank, expert)
            copy = slot >= layout.expert_tp * layout.ep
        else:  # split over TP; slots from tp on repeat earlier ones (e.g. every EP rank's router)
            plan = megatron_tensor_plan(shape, spec, layer, local_name, tp, tp_rank, expert)
            copy = slot >= tp
        plans.append(dataclasses.replace(plan, is_copy=plan.is_copy or copy, expert=spec.expert))

    if chunk.pre_process:
        add(table.embedding, None, table.embedding.megatron)
    for local, layer in enumerate(chunk.layers):
        for spec in table.layer:
            if not spec.exists(shape, layer):
                continue
            if spec.expert:
                for local_expert in range(per_rank):
                    add(spec, layer, spec.megatron.format(i=local, e=local_expert),
                        ep_rank * per_rank + local_expert)
            else:
                add(spec, layer, spec.megatron.format(i=local))
    if chunk.post_process:
        add(table.final_norm, None, table.final_norm.megatron)
        if not shape.tie_word_embeddings:
            add(table.lm_head, None, table.lm_head.megatron)
        elif not chunk.pre_process:
            # Tied and on another stage than the embedding: megatron keeps a synchronized copy here.
            copy = megatron_tensor_plan(shape, table.embedding, None, table.lm_head.megatron, tp, tp_rank)
            plans.append(TensorPlan(copy.name, copy.shape, copy.axis, copy.segments, is_copy=True))
    return plans


def rank_tensor_plans(
    shape: ModelShape, layout: ParallelLayout, tp_rank: int, pp_rank: int, ep_rank: int = 0,
    etp_rank: int | None = None,
) -> dict[str, TensorPlan]:
    """All tensors of one (TP, PP, EP, ETP) rank keyed as in its checkpoint file (VPP chunks prefixed)."""
    out: dict[str, TensorPlan] = {}
    for chunk in layout.chunks(shape.num_layers, pp_rank):
        prefix = rank_chunk_key_prefix(layout, chunk.vp_stage)
        for plan in chunk_tensor_plans(shape, layout, chunk, tp_rank, ep_rank, etp_rank):
            out[prefix + plan.name] = plan
    return out


@dataclass(frozen=True)
class ShardRange:
    """Rows [hf_start, hf_stop) of HF tensor `hf_name` inside one megatron tensor of one (TP, PP) rank,
    starting at `shard_offset` along `axis` (None: the whole tensor)."""

    hf_name: str
    tp_rank: int
    pp_rank: int
    chunk: int  # index of the model chunk (VPP stage) in that rank's model list
    key: str  # key in that rank's checkpoint file (VPP chunks prefixed)
    mcore_name: str  # name inside the chunk's state_dict
    shape: tuple[int, ...]  # shape of the megatron tensor
    axis: int | None
    shard_offset: int
    hf_start: int
    hf_stop: int
    is_copy: bool  # a replicated copy or the tied output layer's copy of the embedding
    ep_rank: int = 0  # the expert-parallel rank (0 for a dense layout)
    etp_rank: int = 0  # the expert TP rank (tp_rank % etp; tp_rank when ETP = TP)

    @property
    def rank(self) -> ModelRank:
        """The rank file holding it."""
        return ModelRank(self.tp_rank, self.pp_rank, self.ep_rank, self.etp_rank)


def shard_ranges(shape: ModelShape, layout: ParallelLayout) -> dict[str, list[ShardRange]]:
    """HF name -> every megatron range of it over all slots of every stage of one replica (copies included)."""
    out: dict[str, list[ShardRange]] = {name: [] for name in hf_tensor_shapes(shape)}
    for tp_rank, pp_rank, ep_rank, etp_rank in layout.model_ranks():
        for index, chunk in enumerate(layout.chunks(shape.num_layers, pp_rank)):
            prefix = rank_chunk_key_prefix(layout, chunk.vp_stage)
            for plan in chunk_tensor_plans(shape, layout, chunk, tp_rank, ep_rank, etp_rank):
                offset = 0
                for seg in plan.segments:
                    if seg.hf_name is not None:
                        out[seg.hf_name].append(ShardRange(
                            seg.hf_name, tp_rank, pp_rank, index, prefix + plan.name, plan.name,
                            plan.shape, plan.axis, offset, seg.start, seg.stop, plan.is_copy, ep_rank, etp_rank,
                        ))
                    offset += seg.length
    return out


def hf_export_map(shape: ModelShape, layout: ParallelLayout) -> dict[str, list[ShardRange]]:
    """For each HF tensor, the megatron ranges that rebuild it exactly once (copies and padding skipped)."""
    pieces = {name: [r for r in found if not r.is_copy] for name, found in shard_ranges(shape, layout).items()}
    hf_shapes = hf_tensor_shapes(shape)
    for name, found in pieces.items():
        axis = hf_tensor_axis(shape, name)
        covered = sum(p.hf_stop - p.hf_start for p in found)
        expected = hf_shapes[name][axis] if axis is not None else hf_shapes[name][0]
        if (axis is None and len(found) != 1) or (axis is not None and covered != expected):
            raise ParallelLayoutError(f"layout bug: {name} covered {covered}/{expected} by {found}")
    return pieces


def rank_numel(shape: ModelShape, layout: ParallelLayout, tp_rank: int = 0, pp_rank: int = 0,
               ep_rank: int = 0, etp_rank: int | None = None) -> int:
    """Elements this rank's model chunks hold (vocab padding and tied/replicated copies included):
    the parameter count a memory estimate for that rank needs."""
    total = 0
    for plan in rank_tensor_plans(shape, layout, tp_rank, pp_rank, ep_rank, etp_rank).values():
        count = 1
        for dim in plan.shape:
            count *= dim
        total += count
    return total


def max_rank_numel(shape: ModelShape, layout: ParallelLayout) -> int:
    """The largest `rank_numel` over all rank files (first/last stages carry the embeddings)."""
    return max(rank_numel(shape, layout, *rank) for rank in layout.model_ranks())
