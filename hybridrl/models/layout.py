"""HF ⇄ megatron weight layout as pure data: which HF rows/columns make each megatron shard.

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
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridrl.models.arch import ModelShape, ParallelLayoutError

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


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
    """One megatron tensor of one rank: `segments` concatenated along `axis` (None: a whole copy)."""

    mcore_name: str
    shape: tuple[int, ...]
    axis: int | None
    segments: tuple[Segment, ...]
    # A replicated tensor (norm) or the duplicate of a tied embedding on the last stage: exports
    # take the value from one holder, so these copies are skipped when reassembling HF tensors.
    is_copy: bool = False

    @property
    def hf_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.hf_name for s in self.segments if s.hf_name is not None))


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


@dataclass(frozen=True)
class ParallelLayout:
    """TP/PP/VPP sizes of a sharded model, with megatron's even layer split."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None

    def __post_init__(self) -> None:
        if self.vpp == 1:
            object.__setattr__(self, "vpp", None)

    @property
    def num_chunks_per_stage(self) -> int:
        return self.vpp or 1

    def chunks(self, num_layers: int, pp_rank: int) -> list[StageChunk]:
        """The chunks `pp_rank` owns, in vp_stage order (megatron's even offset rule)."""
        if not 0 <= pp_rank < self.pp:
            raise ParallelLayoutError(f"pp_rank={pp_rank} outside pp={self.pp}")
        vpp = self.num_chunks_per_stage
        if num_layers % (self.pp * vpp):
            raise ParallelLayoutError(
                f"{num_layers} layers do not split evenly over pp={self.pp} x vpp={vpp}"
            )
        per_chunk = num_layers // (self.pp * vpp)
        out = []
        for v in range(vpp):
            # megatron: offset = vp_stage * (layers / vpp) + pp_rank * (layers / (pp * vpp))
            first = v * (num_layers // vpp) + pp_rank * per_chunk
            out.append(StageChunk(
                pp_rank=pp_rank,
                vp_stage=v if self.vpp else None,
                first_layer=first,
                num_layers=per_chunk,
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

    def to_dict(self) -> dict[str, int | None]:
        return {"tp": self.tp, "pp": self.pp, "vpp": self.vpp}


def rank_chunk_key_prefix(layout: ParallelLayout, vp_stage: int | None) -> str:
    """Key prefix of a chunk inside a rank's checkpoint file: '' without VPP, 'model{v}.' with it."""
    return "" if vp_stage is None or layout.vpp is None else f"model{vp_stage}."


def checkpoint_file_name(tp_rank: int, pp_rank: int) -> str:
    return f"model_tp{tp_rank:02d}_pp{pp_rank:03d}.safetensors"


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
    prefix = f"model.layers.{layer}.self_attn"
    q_rows = shape.heads_per_group * shape.head_dim
    d = shape.head_dim
    order: list[Segment] = []
    for g in range(shape.num_kv_heads):
        order.append(Segment(f"{prefix}.q_proj.{kind}", g * q_rows, (g + 1) * q_rows))
        order.append(Segment(f"{prefix}.k_proj.{kind}", g * d, (g + 1) * d))
        order.append(Segment(f"{prefix}.v_proj.{kind}", g * d, (g + 1) * d))
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


# ---- the HF side ----------------------------------------------------------------------------------

def hf_tensor_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this model holds, with its shape, in HF's usual order."""
    h, d = shape.hidden_size, shape.head_dim
    out: dict[str, tuple[int, ...]] = {EMBED: (shape.vocab_size, h)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (h,)
        out[f"{p}.self_attn.q_proj.weight"] = (shape.q_size, h)
        out[f"{p}.self_attn.k_proj.weight"] = (shape.kv_size, h)
        out[f"{p}.self_attn.v_proj.weight"] = (shape.kv_size, h)
        if shape.qkv_bias:
            out[f"{p}.self_attn.q_proj.bias"] = (shape.q_size,)
            out[f"{p}.self_attn.k_proj.bias"] = (shape.kv_size,)
            out[f"{p}.self_attn.v_proj.bias"] = (shape.kv_size,)
        if shape.qk_norm:
            out[f"{p}.self_attn.q_norm.weight"] = (d,)
            out[f"{p}.self_attn.k_norm.weight"] = (d,)
        out[f"{p}.self_attn.o_proj.weight"] = (h, shape.q_size)
        out[f"{p}.post_attention_layernorm.weight"] = (h,)
        out[f"{p}.mlp.gate_proj.weight"] = (shape.ffn_hidden_size, h)
        out[f"{p}.mlp.up_proj.weight"] = (shape.ffn_hidden_size, h)
        out[f"{p}.mlp.down_proj.weight"] = (h, shape.ffn_hidden_size)
    out[FINAL_NORM] = (h,)
    if not shape.tie_word_embeddings:
        out[LM_HEAD] = (shape.vocab_size, h)
    return out


# Tensors an HF checkpoint may carry that hold no weights (buffers saved by old transformers).
IGNORED_HF_SUFFIXES: tuple[str, ...] = (".rotary_emb.inv_freq",)


def hf_tensor_axis(shape: ModelShape, hf_name: str) -> int | None:
    """The axis along which megatron splits this HF tensor (None: replicated), for slice reads."""
    if hf_name.endswith(("o_proj.weight", "down_proj.weight")):
        return 1
    if hf_name.endswith(("layernorm.weight", "norm.weight")):
        return None
    return 0


# ---- the megatron side ----------------------------------------------------------------------------

def chunk_tensor_plans(
    shape: ModelShape, layout: ParallelLayout, chunk: StageChunk, tp_rank: int
) -> list[TensorPlan]:
    """Plans for every tensor in the `state_dict()` of one GPTModel chunk (local spec names)."""
    tp = layout.tp
    if not 0 <= tp_rank < tp:
        raise ParallelLayoutError(f"tp_rank={tp_rank} outside tp={tp}")
    h, f, d = shape.hidden_size, shape.ffn_hidden_size, shape.head_dim
    plans: list[TensorPlan] = []

    def split(name: str, axis: int, full: list[Segment], other: int) -> None:
        segs = _tp_chunk(full, tp_rank, tp)
        rows = sum(s.length for s in segs)
        shp = (rows, other) if axis == 0 else (other, rows)
        plans.append(TensorPlan(name, shp, axis, segs))

    def vector(name: str, full: list[Segment]) -> None:
        segs = _tp_chunk(full, tp_rank, tp)
        plans.append(TensorPlan(name, (sum(s.length for s in segs),), 0, segs))

    def whole(name: str, hf_name: str, size: int) -> None:
        plans.append(TensorPlan(name, (size,), None, (Segment(hf_name, 0, size),), is_copy=tp_rank > 0))

    if chunk.pre_process:
        split("embedding.word_embeddings.weight", 0, vocab_order(shape, EMBED, tp), h)
    for local, layer in enumerate(chunk.layers):
        p, hp = f"decoder.layers.{local}", f"model.layers.{layer}"
        whole(f"{p}.input_layernorm.weight", f"{hp}.input_layernorm.weight", h)
        split(f"{p}.self_attention.linear_qkv.weight", 0, fused_qkv_order(shape, layer), h)
        if shape.qkv_bias:
            vector(f"{p}.self_attention.linear_qkv.bias", fused_qkv_order(shape, layer, "bias"))
        if shape.qk_norm:
            whole(f"{p}.self_attention.q_layernorm.weight", f"{hp}.self_attn.q_norm.weight", d)
            whole(f"{p}.self_attention.k_layernorm.weight", f"{hp}.self_attn.k_norm.weight", d)
        split(f"{p}.self_attention.linear_proj.weight", 1,
              [Segment(f"{hp}.self_attn.o_proj.weight", 0, shape.q_size)], h)
        whole(f"{p}.pre_mlp_layernorm.weight", f"{hp}.post_attention_layernorm.weight", h)
        # fc1 rank r = [gate shard r; up shard r]: two per-rank ranges, not a split of [gate; up].
        part = f // tp
        fc1 = (Segment(f"{hp}.mlp.gate_proj.weight", tp_rank * part, (tp_rank + 1) * part),
               Segment(f"{hp}.mlp.up_proj.weight", tp_rank * part, (tp_rank + 1) * part))
        plans.append(TensorPlan(f"{p}.mlp.linear_fc1.weight", (2 * part, h), 0, fc1))
        split(f"{p}.mlp.linear_fc2.weight", 1, [Segment(f"{hp}.mlp.down_proj.weight", 0, f)], h)
    if chunk.post_process:
        whole("decoder.final_layernorm.weight", FINAL_NORM, h)
        if not shape.tie_word_embeddings:
            split("output_layer.weight", 0, vocab_order(shape, LM_HEAD, tp), h)
        elif not chunk.pre_process:
            # Tied and on another stage than the embedding: megatron keeps a synchronized copy here.
            segs = _tp_chunk(vocab_order(shape, EMBED, tp), tp_rank, tp)
            plans.append(TensorPlan("output_layer.weight", (sum(s.length for s in segs), h), 0, segs,
                                    is_copy=True))
    return plans


def rank_tensor_plans(
    shape: ModelShape, layout: ParallelLayout, tp_rank: int, pp_rank: int
) -> dict[str, TensorPlan]:
    """All tensors of one (TP, PP) rank keyed as in its checkpoint file (VPP chunks prefixed)."""
    out: dict[str, TensorPlan] = {}
    for chunk in layout.chunks(shape.num_layers, pp_rank):
        prefix = rank_chunk_key_prefix(layout, chunk.vp_stage)
        for plan in chunk_tensor_plans(shape, layout, chunk, tp_rank):
            out[prefix + plan.mcore_name] = plan
    return out


@dataclass(frozen=True)
class Piece:
    """Where part of an HF tensor lives in a sharded checkpoint: for `hf_export_map`."""

    tp_rank: int
    pp_rank: int
    key: str  # key in that rank's file
    axis: int | None
    shard_offset: int  # start along `axis` inside the megatron tensor
    hf_start: int
    hf_stop: int


def hf_export_map(shape: ModelShape, layout: ParallelLayout) -> dict[str, list[Piece]]:
    """For each HF tensor, the megatron pieces that rebuild it exactly once (copies and padding skipped)."""
    pieces: dict[str, list[Piece]] = {name: [] for name in hf_tensor_shapes(shape)}
    for pp_rank in range(layout.pp):
        for tp_rank in range(layout.tp):
            for key, plan in rank_tensor_plans(shape, layout, tp_rank, pp_rank).items():
                if plan.is_copy:
                    continue
                offset = 0
                for seg in plan.segments:
                    if seg.hf_name is not None:
                        pieces[seg.hf_name].append(
                            Piece(tp_rank, pp_rank, key, plan.axis, offset, seg.start, seg.stop)
                        )
                    offset += seg.length
    hf_shapes = hf_tensor_shapes(shape)
    for name, found in pieces.items():
        axis = hf_tensor_axis(shape, name)
        covered = sum(p.hf_stop - p.hf_start for p in found)
        expected = hf_shapes[name][axis] if axis is not None else hf_shapes[name][0]
        if (axis is None and len(found) != 1) or (axis is not None and covered != expected):
            raise ParallelLayoutError(f"layout bug: {name} covered {covered}/{expected} by {found}")
    return pieces


def rank_numel(shape: ModelShape, layout: ParallelLayout, tp_rank: int = 0, pp_rank: int = 0) -> int:
    """Elements this rank's model chunks hold (vocab padding and tied/replicated copies included):
    the parameter count a memory estimate for that rank needs."""
    total = 0
    for plan in rank_tensor_plans(shape, layout, tp_rank, pp_rank).values():
        count = 1
        for dim in plan.shape:
            count *= dim
        total += count
    return total


def max_rank_numel(shape: ModelShape, layout: ParallelLayout) -> int:
    """The largest `rank_numel` over all TP x PP ranks (first/last stages carry the embeddings)."""
    return max(rank_numel(shape, layout, t, p) for p in range(layout.pp) for t in range(layout.tp))
