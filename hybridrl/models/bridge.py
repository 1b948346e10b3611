"""Build megatron-core GPTModels for this rank from an HF model, load weights into them, export them.

Typical use on every rank of a training group (after `hybridrl.parallel.state.initialize_model_parallel`):

    source = ModelSource.from_path(hf_dir)              # or a hybridrl megatron checkpoint folder
    models = build_gpt_models(source)                  # one GPTModel per VPP chunk of this rank
    load_weights(models, hf_dir)                       # HF folder or megatron checkpoint, any layout
    ...
    save_mcore_checkpoint(models, ckpt_dir)            # collective: one file per rank file position
    export_hf(models, hf_out_dir)                      # collective: HF folder written by rank 0

Loading streams: each tensor of this rank is read as the exact HF row/column ranges it needs
(`layout.TensorPlan`, `safetensors` slices), so no rank ever materializes the full model.

megatron is imported inside the functions that need it: the Ray driver imports this module (through
the resharder and the workers) and must not import megatron.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridrl.models.arch import ModelShape, read_hf_config
from hybridrl.models.checkpoint import (
    ASSET_PATTERNS,
    ASSETS_DIR,
    METADATA_FILE,
    HFCheckpointReader,
    McoreCheckpointReader,
    McoreMetadata,
    assemble,
    estimated_hf_bytes,
    hf_export_dtype,
    mcore_metadata,
    tensor_sha256,
    write_hf_files,
    write_rank_file,
)
from hybridrl.models.layout import (
    ModelRank,
    ParallelLayout,
    StageChunk,
    TensorPlan,
    chunk_tensor_plans,
    rank_chunk_key_prefix,
    rank_file_fields,
    rank_file_name,
)
from hybridrl.models.lora import ADAPTER_ATTR
from hybridrl.parallel.device import default_dtype_for, layer_spec_kind, megatron_cpu_initialization, rank_device
from hybridrl.parallel.device_policy import DevicePolicy
from hybridrl.parallel.state import failed_ranks, get_context
from hybridrl.persistence import (
    CheckpointError,
    check_free_space,
    commit_staging_dir,
    discard_staging_dir,
    make_staging_dir,
)

# Transformer Engine fuses the pre-attention / pre-MLP norms into the following linear layer; the
# checkpoint and the layout math use the local spec's names, translated here for TE models.
TE_NAMES: dict[str, str] = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


@dataclass(frozen=True)
class ModelSource:
    """What a model is, independent of its weights' layout: shape, HF config, generation config."""

    shape: ModelShape
    hf_config: dict[str, Any]
    generation_config: dict[str, Any] | None = None
    assets_dir: Path | None = None  # tokenizer files to carry into checkpoints

    @classmethod
    def from_path(cls, path: str | Path) -> ModelSource:
        path = Path(path)
        if (path / METADATA_FILE).is_file():
            meta = McoreMetadata.read(path)
            assets = path / ASSETS_DIR
            return cls(meta.shape, meta.hf_config, meta.raw.get("generation_config"),
                       assets if assets.is_dir() else None)
        config = read_hf_config(path)
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
        return cls(ModelShape.from_hf_config(config), config, gen, path)

    @classmethod
    def from_config(cls, hf_config: Mapping[str, Any]) -> ModelSource:
        return cls(ModelShape.from_hf_config(hf_config), dict(hf_config))


@dataclass
class ChunkInfo:
    """Bridge bookkeeping attached to each built GPTModel (`model.hybridrl`)."""

    source: ModelSource
    layout: ParallelLayout
    chunk: StageChunk
    tp_rank: int
    spec_kind: str
    ep_rank: int = 0
    etp_rank: int | None = None  # None: tp_rank % the expert TP size (tp_rank when ETP = TP)

    def tensor_plans(self) -> list[TensorPlan]:
        """This chunk's tensors as the layout math describes them."""
        return chunk_tensor_plans(self.source.shape, self.layout, self.chunk, self.tp_rank, self.ep_rank,
                                  self.etp_rank)

    @property
    def rank(self) -> ModelRank:
        """The rank file position of this rank's tensors (`layout.ModelRank`)."""
        slot = self.layout.slot_of(self.tp_rank, self.ep_rank, self.etp_rank)
        tp_rank, ep_rank, etp_rank = self.layout.slot_ranks(slot)
        return ModelRank(tp_rank, self.chunk.pp_rank, ep_rank, etp_rank)


def _context(ctx: Any = None) -> Any:
    if ctx is not None:
        return ctx
    return get_context()


def _as_source(source: ModelSource | str | Path | Mapping[str, Any]) -> ModelSource:
    if isinstance(source, ModelSource):
        return source
    if isinstance(source, Mapping):
        return ModelSource.from_config(source)
    return ModelSource.from_path(source)


def transformer_config(
    shape: ModelShape, tp: int, pp: int, vpp: int | None, *, device: str, dtype: torch.dtype,
    ep: int = 1, first_stage_layers: int | None = None, last_stage_layers: int | None = None,
    etp: int | None = None, cpu_stand_ins: bool = True, **overrides: Any,
) -> Any:
    """megatron `TransformerConfig` for `shape` on a resolved `device`, with the CPU layer's flags
    where the device policy runs megatron through it (CPU). `cpu_stand_ins=False` (the plan's check of a
    role's settings) installs none of the CPU layer's functions and leaves megatron's fused RoPE off."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    kwargs = shape.megatron_config_kwargs(tp, pp, vpp, ep, first_stage_layers=first_stage_layers,
                                          last_stage_layers=last_stage_layers, etp=etp)
    kwargs["activation_func"] = {"silu": F.silu}[kwargs["activation_func"]]
    kwargs.update(
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Weights come from a checkpoint: skip random init (and the full-size master tensors
        # megatron's CPU init would build per parameter).
        perform_initialization=False,
        use_cpu_initialization=megatron_cpu_initialization(device),
        # megatron's default scope, "full" (the whole layer), is deprecated for this spelling of it, and warned about
        # at every config built
        cuda_graph_scope=[],
    )
    if DevicePolicy.for_device(device).megatron_cpu_layer:
        from hybridrl.parallel.cpu.attention import install_cpu_packed_rope
        from hybridrl.parallel.cpu.layer import CPU_CONFIG_OVERRIDES
        from hybridrl.parallel.cpu.rope import install_cpu_fused_rope

        kwargs.update(CPU_CONFIG_OVERRIDES)
        # megatron's fused-RoPE slot, filled with a CPU function that gives the unfused path's
        # numbers in fewer memory passes (hybridrl/parallel/cpu/rope.py)
        kwargs["apply_rope_fusion"] = cpu_stand_ins and install_cpu_fused_rope()
        if kwargs["apply_rope_fusion"] and not install_cpu_packed_rope():
            # packed (THD) sequences call the packed slot: without our function there, keep the
            # unfused path for both (the numbers are the same)
            kwargs["apply_rope_fusion"] = False
    kwargs.update(overrides)
    config = TransformerConfig(**kwargs)
    # YaRN: what megatron's GPTModel reads with getattr and no TransformerConfig field declares (arch.py)
    for name, value in shape.megatron_yarn_attributes().items():
        setattr(config, name, value)
    return config


def layer_spec(shape: ModelShape, kind: str, config: Any = None, chunk: StageChunk | None = None, *,
               cpu_layer: bool = False) -> Any:
    """The GPT layer spec (dense), or for an MoE model this chunk's block spec: megatron's per-layer
    choice between the MoE and the dense layer (`moe_layer_freq`) for the layers `chunk` holds. On the local
    spec under sequence parallelism every norm is torch's with its weights tagged as TE's are
    (`sequence_parallel_norm`: megatron's own torch norm refuses SP); every local layer's core attention is, with
    `cpu_layer` (the device policy's `megatron_cpu_layer`), the CPU layer's stand-in that also serves packed
    sequences and context parallelism, else PyTorch's fused attention (`sdpa_attention`)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if shape.is_moe:
        if config is None or chunk is None:
            raise ValueError("an MoE model's layer spec needs its TransformerConfig and chunk")
        _define_missing_te_gemm()
        spec = gpt_layer_specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=kind == "te", normalization="RMSNorm",
            vp_stage=chunk.vp_stage, pp_rank=chunk.pp_rank)
    elif kind == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=shape.qk_norm)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=shape.qk_norm, normalization="RMSNorm")
    if kind == "te":
        return spec
    if cpu_layer:
        from hybridrl.parallel.cpu.attention import cpu_packed_attention_class

        spec = _with_core_attention(spec, cpu_packed_attention_class())
    else:  # a GPU's local spec (no TE, or LoRA adapters): PyTorch's fused attention, not megatron's unfused one
        from hybridrl.parallel.sdpa_attention import sdpa_attention_class

        spec = _with_core_attention(spec, sdpa_attention_class())
    if config is not None and config.sequence_parallel:
        from hybridrl.parallel.sequence_parallel_norm import with_sequence_parallel_norms

        if chunk is None:
            raise ValueError("a sequence-parallel local layer spec needs its chunk")
        spec = with_sequence_parallel_norms(spec, chunk.num_layers)
    return spec


def _with_core_attention(spec: Any, attention: type) -> Any:
    """The local GPT layer `spec`, or every layer of a block spec (MoE models: `layer_specs`, dense and MoE layers),
    with megatron's `DotProductAttention` core attention replaced by `attention` (in place; returned)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    for layer in getattr(spec, "layer_specs", None) or [spec]:
        submodules = layer.submodules.self_attention.submodules
        if submodules.core_attention is attention:  # block specs share one spec object between layers
            continue
        if submodules.core_attention is not DotProductAttention:
            raise ValueError(f"expected megatron's local DotProductAttention in the layer spec, found "
                             f"{submodules.core_attention!r}")
        submodules.core_attention = attention
    return spec


def _define_missing_te_gemm() -> None:
    """megatron-core 0.16.1's router linear (`moe_utils.RouterGatingLinearFunction`) tests
    `te_general_gemm is not None`, a name bound only when Transformer Engine imports: without TE it
    raises NameError. None is what the test means by "no TE" (it then uses torch.mm)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_gpt_models(
    source: ModelSource | str | Path | Mapping[str, Any],
    *,
    ctx: Any = None,
    dtype: torch.dtype | str | None = None,
    config_overrides: Mapping[str, Any] | None = None,
    spec_kind: str | None = None,
) -> list[Any]:
    """This rank's GPTModel chunks (one per VPP stage, megatron's model list), weights not loaded.

    `ctx` is the `ParallelContext` (default: the current one). `dtype` defaults to fp32 on CPU and
    bf16 on CUDA. The layer spec is local on CPU and TE on CUDA when Transformer Engine is installed
    (`spec_kind` forces one).
    """
    from megatron.core.models.gpt import GPTModel

    ctx = _context(ctx)
    src = _as_source(source)
    shape = src.shape
    layout = ParallelLayout.of_context(ctx)
    shape.check_parallel(**layout.sizes())
    torch_dtype = default_dtype_for(ctx.device, dtype)
    kind = spec_kind or layer_spec_kind(ctx.device)
    config = transformer_config(shape, layout.tp, layout.pp, layout.vpp, device=ctx.device, dtype=torch_dtype,
                                ep=layout.ep, first_stage_layers=layout.first_stage_layers,
                                last_stage_layers=layout.last_stage_layers, etp=layout.etp,
                                context_parallel_size=ctx.cp, **dict(config_overrides or {}))
    # The layout's slots must be megatron's two meshes: the dense one's TP rank and the expert one's
    # EP and expert TP ranks of this rank (its local index in its pipeline stage, tp fastest).
    local = ctx.rank % (ctx.world_size // ctx.pp)
    ranks = (ctx.tp_rank, getattr(ctx, "ep_rank", 0), getattr(ctx, "etp_rank", ctx.tp_rank))
    if shape.is_moe and layout.slot_ranks(local) != ranks:
        raise RuntimeError(f"rank {ctx.rank}: megatron placed (tp, ep, etp) ranks {ranks}, the layout's slot "
                           f"{local % layout.slots} says {layout.slot_ranks(local)}")
    cpu_layer = DevicePolicy.for_device(ctx.device).megatron_cpu_layer
    models = []
    for chunk in layout.chunks(shape.num_layers, ctx.pp_rank):
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(shape, kind, config, chunk, cpu_layer=cpu_layer),
            pre_process=chunk.pre_process,
            post_process=chunk.post_process,
            parallel_output=True,
            vp_stage=chunk.vp_stage,
            **shape.gpt_model_kwargs(layout.tp),
        )
        # Layers megatron builds without a device (the torch norms of the local spec) join the rest.
        model.to(rank_device(ctx.device))
        first_layer = model.decoder.layers[0].layer_number - 1 if len(model.decoder.layers) else None
        built = len(model.decoder.layers)
        if (first_layer is not None and first_layer != chunk.first_layer) or built != chunk.num_layers:
            raise RuntimeError(f"megatron placed {built} layers from layer {first_layer} in "
                               f"chunk {chunk}, layout math expects {chunk.num_layers} from {chunk.first_layer}")
        _mark_tensor_parallel_params(model)
        _mark_expert_params(model, layout)
        model.hybridrl = ChunkInfo(src, layout, chunk, ctx.tp_rank, kind, getattr(ctx, "ep_rank", 0),
                                   getattr(ctx, "etp_rank", None) if shape.is_moe else None)
        models.append(model)
    return models


def _mark_tensor_parallel_params(model: Any) -> None:
    """Tag TP-sharded weights with megatron's `tensor_model_parallel`/`partition_dim` attributes.

    Megatron sets them only inside its weight initialization, which `perform_initialization=False`
    skips. Without them every shard counts as a TP duplicate: the grad norm (and so clipping) only
    sees TP rank 0's shards, and training at TP > 1 diverges from TP = 1.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)) \
                or getattr(module, "parallel_mode", None) == "column":
            dims = {"weight": 0, "bias": 0}
        elif isinstance(module, RowParallelLinear) or getattr(module, "parallel_mode", None) == "row":
            dims = {"weight": 1}  # a row-parallel bias is whole on every rank
        else:
            continue
        for name, dim in dims.items():
            param = getattr(module, name, None)
            if isinstance(param, torch.nn.Parameter) and not getattr(param, "tensor_model_parallel", False):
                set_tensor_model_parallel_attributes(param, True, dim, 1)


def _mark_expert_params(model: Any, layout: ParallelLayout) -> None:
    """Give the routed experts' weights megatron's `allreduce=False` (an expert-parallel parameter)
    wherever their replicas are not the dense DP replicas: EP > 1, or an expert TP other than TP.

    megatron-core 0.16.1 sets `allreduce = not (is_expert and expert_model_parallel_size > 1)`
    (`ColumnParallelLinear` / `RowParallelLinear`). At EP 1 with ETP = 2 > TP = 1 the two DP ranks
    hold different halves of each expert, so DDP's all-reduce over DP would add one half's gradient
    to the other's (measured: expert updates at cos 0.48 with the ETP1 run's). As expert-parallel
    parameters they are reduced over the expert-DP group instead and stepped by the expert optimizer
    (megatron's `allreduce` flag decides both).
    """
    if layout.ep == 1 and layout.etp is None:
        return  # experts replicated like the dense weights: megatron's own flag is right
    for module in model.modules():
        if getattr(module, "is_expert", False):
            for param in module.parameters(recurse=False):
                param.allreduce = False


def build_gpt_model(source: ModelSource | str | Path | Mapping[str, Any], **kwargs: Any) -> Any:
    """The single GPTModel of this rank (no VPP); see `build_gpt_models`."""
    models = build_gpt_models(source, **kwargs)
    if len(models) != 1:
        raise ValueError(f"this rank has {len(models)} VPP chunks: use build_gpt_models")
    return models[0]


def chunk_info(model: Any) -> ChunkInfo:
    """The layout facts `build_gpt_models` attached to a chunk (looks through DDP/Float16 wrappers)."""
    info = getattr(model, "hybridrl", None)
    if info is None:
        module = getattr(model, "module", None)  # megatron DDP / Float16Module wrappers
        if module is not None:
            return chunk_info(module)
        raise ValueError("model was not built by hybridrl.models.bridge.build_gpt_models")
    return info


def unwrap_model(model: Any) -> Any:
    """The GPTModel inside megatron's DDP / Float16Module wrappers."""
    while getattr(model, "hybridrl", None) is None and hasattr(model, "module"):
        model = model.module
    return model


def spec_tensor_name(local_name: str, info: ChunkInfo) -> str:
    """A tensor's state_dict name in `info`'s chunk under its layer spec (local names are the layout's).

    megatron's TE spec fuses the pre-MLP norm into the dense MLP's fc1 only: an MoE layer keeps it
    as its own `pre_mlp_layernorm` (`get_gpt_layer_with_transformer_engine_spec`), which the chunk
    (which of its layers are MoE) decides: so the chunk is required, not only the spec's kind.
    """
    if info.spec_kind == "te":
        for local_suffix, te_suffix in TE_NAMES.items():
            if local_name.endswith(local_suffix):
                if local_suffix.startswith("pre_mlp") and _in_moe_layer(local_name, info):
                    return local_name
                return local_name[: -len(local_suffix)] + te_suffix
    return local_name


def _in_moe_layer(local_name: str, info: ChunkInfo) -> bool:
    parts = local_name.split(".")
    if parts[:2] != ["decoder", "layers"]:
        return False
    return info.source.shape.layer_is_moe(info.chunk.first_layer + int(parts[2]))


def model_tensors(model: Any) -> dict[str, torch.Tensor]:
    """Parameters (and persistent non-extra-state buffers) by state_dict name: the model's own, without LoRA
    adapters (`hybridrl.models.lora`), which sit beside the layers they adapt."""
    # `_extra_state` entries are TE/fp8 bookkeeping (None on the local spec), not weights.
    adapters = f".{ADAPTER_ATTR}."
    return {
        k: v for k, v in model.state_dict(keep_vars=True).items()
        if v is not None and not k.endswith("_extra_state") and adapters not in k
    }


def checked_model_tensors(model: Any, names: Sequence[str], info: ChunkInfo) -> dict[str, torch.Tensor]:
    """`model_tensors`, after checking they are exactly the layout's `names` (else the two disagree)."""
    tensors = model_tensors(model)
    expected = {spec_tensor_name(n, info) for n in names}
    if set(tensors) != expected:
        raise RuntimeError(
            f"layout math and the megatron model disagree for chunk {info.chunk}: only in model "
            f"{sorted(set(tensors) - expected)[:5]}, only in layout {sorted(expected - set(tensors))[:5]}"
        )
    return tensors


def chunk_tensors(model: Any) -> tuple[list[TensorPlan], dict[str, torch.Tensor]]:
    """A built chunk's tensor plans, and its tensors by the layout's (local-spec) names, whatever the layer
    spec names them (checked against the layout first, `checked_model_tensors`)."""
    model = unwrap_model(model)
    info = chunk_info(model)
    plans = info.tensor_plans()
    tensors = checked_model_tensors(model, [p.name for p in plans], info)
    return plans, {p.name: tensors[spec_tensor_name(p.name, info)] for p in plans}


@torch.no_grad()
def load_weights(models: Sequence[Any], path: str | Path, verify: bool = True) -> None:
    """Load an HF folder or a hybridrl megatron checkpoint (any TP/PP layout) into this rank's chunks.

    A megatron checkpoint with this rank's exact layout is read file-to-parameter with its checksums
    verified; any other source is read range by range through the layout math.
    """
    models = [unwrap_model(m) for m in models]
    info0 = chunk_info(models[0])
    path = Path(path)
    if (path / METADATA_FILE).is_file():
        meta = McoreMetadata.read(path)
        if meta.layout == info0.layout and meta.shape == info0.source.shape:
            _load_same_layout(models, meta, verify)
            return
        reader: Any = McoreCheckpointReader(path, verify=verify)
    else:
        reader = HFCheckpointReader(path)
    try:
        if reader.shape != info0.source.shape:
            raise CheckpointError(
                f"{path} holds {reader.shape}, the model was built for {info0.source.shape}"
            )
        for model in models:
            plans, tensors = chunk_tensors(model)
            for plan in plans:
                target = tensors[plan.name]
                target.copy_(assemble(reader, plan, target.dtype))
    finally:
        reader.close()


def _load_same_layout(models: Sequence[Any], meta: McoreMetadata, verify: bool) -> None:
    from safetensors import safe_open

    info0 = chunk_info(models[0])
    fname = rank_file_name(info0.layout, *info0.rank)
    recorded = meta.files[fname]["tensors"]
    with safe_open(str(meta.path / fname), framework="pt") as handle:
        file_keys = set(handle.keys())
        for model in models:
            info = chunk_info(model)
            prefix = rank_chunk_key_prefix(info.layout, info.chunk.vp_stage)
            plans, tensors = chunk_tensors(model)
            for plan in plans:
                key = prefix + plan.name
                if key not in file_keys:
                    raise CheckpointError(f"{meta.path / fname} lacks tensor {key}")
                value = handle.get_tensor(key)
                if verify and tensor_sha256(value) != recorded[key]["sha256"]:
                    raise CheckpointError(f"checksum mismatch in {meta.path / fname}, tensor {key}: the file "
                                          "was modified or corrupted after it was written")
                tensors[plan.name].copy_(value)


# ---- saving and export (collective over the world) -------------------------------------------------

_EXPORT_SHARDS = ".megatron-shards"  # inside an HF export's staging folder only; deleted before the rename

def _all_ok(ok: bool, detail: str) -> None:
    """Raise on every rank if any rank failed (so no rank waits in a later collective)."""
    failed = failed_ranks(ok, detail)
    if failed:
        raise CheckpointError("checkpoint save failed on " + "; ".join(failed))


def shared_staging_dir(out_dir: Path, force: bool, ctx: Any) -> Path:
    """Collective: rank 0 checks `out_dir` and makes its staging folder (`hybridrl.persistence`); every
    rank gets its path, or the same `CheckpointError` when rank 0 could not (no rank left waiting)."""
    import torch.distributed as dist

    holder: list[Any] = [None]
    if ctx.rank == 0:
        try:
            holder[0] = str(make_staging_dir(out_dir, force))
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            holder[0] = exc
    dist.broadcast_object_list(holder, src=0)
    if isinstance(holder[0], Exception):
        raise CheckpointError(str(holder[0]))
    return Path(holder[0])


def rank_tensor_entries(models: Sequence[Any]) -> Iterator[tuple[str, TensorPlan, torch.Tensor]]:
    """This rank's tensors as the rank files key them: (key, its tensor plan, the model tensor).

    Keys carry the VPP chunk prefix; the model's tensors are checked against the layout first.
    """
    for model in models:
        info = chunk_info(model)
        prefix = rank_chunk_key_prefix(info.layout, info.chunk.vp_stage)
        plans, tensors = chunk_tensors(model)
        for plan in plans:
            yield prefix + plan.name, plan, tensors[plan.name]


def _rank_tensors(models: Sequence[Any]) -> dict[str, torch.Tensor]:
    return {key: value.detach().cpu() for key, _, value in rank_tensor_entries(models)}


def save_mcore_checkpoint(models: Sequence[Any], out_dir: str | Path, *, ctx: Any = None,
                          force: bool = False) -> Path:
    """Collective: write this model as a hybridrl megatron checkpoint (one file per rank file position:
    TP×PP, ×EP for expert-parallel models, per slot of TP and expert TP×EP when they differ).

    Called by every rank; the first rank of each position, the one whose local index in its pipeline
    stage is below the layout's slots (DP/CP rank 0 of a TP x PP position for a dense model, expert-DP
    rank 0 with ETP = TP), writes its file into a temporary folder next to `out_dir` (a filesystem
    shared by the ranks), rank 0 adds the metadata and renames it into place. Readable by
    `load_weights` and `hybridrl convert`.
    """
    import torch.distributed as dist

    ctx = _context(ctx)
    models = [unwrap_model(m) for m in models]
    info = chunk_info(models[0])
    out_dir = Path(out_dir).absolute()
    tmp = shared_staging_dir(out_dir, force, ctx)
    entry: tuple[str, dict[str, Any]] | None = None
    ok, detail = True, ""
    # The slots of a stage repeat every `slots` local ranks (`layout.ParallelLayout.slots`): the
    # first repetition writes.
    if ctx.rank % (ctx.world_size // ctx.pp) < info.layout.slots:
        try:
            fname = rank_file_name(info.layout, *info.rank)
            entry = (fname, rank_file_fields(info.layout, info.rank)
                     | {"tensors": write_rank_file(tmp / fname, _rank_tensors(models))})
        except Exception as exc:  # noqa: BLE001
            ok, detail = False, f"{type(exc).__name__}: {exc}"
    entries: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(entries, entry)
    try:
        _all_ok(ok, detail)
    except CheckpointError:
        if ctx.rank == 0:
            discard_staging_dir(tmp)
        raise
    ok, detail = True, ""
    if ctx.rank == 0:
        try:
            files = dict(e for e in entries if e is not None)
            src = info.source
            dtype = next(iter(model_tensors(models[0]).values())).dtype
            assets = sorted(p for p in src.assets_dir.iterdir() if p.is_file() and _is_asset(p)) \
                if src.assets_dir else []
            if assets:
                (tmp / ASSETS_DIR).mkdir()
                for p in assets:
                    shutil.copy2(p, tmp / ASSETS_DIR / p.name)
            meta = mcore_metadata(src.shape, info.layout, src.hf_config, dtype, files, src.generation_config,
                                  [p.name for p in assets])
            (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=1))
            commit_staging_dir(tmp, out_dir)
        except Exception as exc:  # noqa: BLE001
            discard_staging_dir(tmp)
            ok, detail = False, f"{type(exc).__name__}: {exc}"
    _all_ok(ok, detail)
    return out_dir


def _is_asset(path: Path) -> bool:
    from fnmatch import fnmatch

    return any(fnmatch(path.name, pattern) for pattern in ASSET_PATTERNS)


def export_hf(
    models: Sequence[Any], out_dir: str | Path, *, ctx: Any = None, dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None, force: bool = False,
    adjust: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> Path:
    """Collective: gather the sharded model into an HF folder at `out_dir` (written by rank 0); `adjust(name,
    tensor)` (rank 0's) changes each HF tensor as it is written (a LoRA actor's merge, `lora.PeftMerge`).

    Written into one staging folder next to `out_dir` (so the ranks need a shared filesystem): the
    shards first travel as a megatron checkpoint inside it, from which rank 0 stitches HF tensors one
    output shard at a time; the megatron copy is then deleted and the folder renamed into place.
    """
    ctx = _context(ctx)
    out_dir = Path(out_dir).absolute()
    staging = shared_staging_dir(out_dir, force, ctx)
    shards = staging / _EXPORT_SHARDS
    try:
        save_mcore_checkpoint(models, shards, ctx=ctx)
    except BaseException:
        if ctx.rank == 0:
            discard_staging_dir(staging)
        raise
    ok, detail = True, ""
    if ctx.rank == 0:
        try:
            reader = McoreCheckpointReader(shards, verify=False)
            try:
                check_free_space(out_dir, estimated_hf_bytes(reader.shape, dtype or hf_export_dtype(reader)))
                kwargs = {"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {}
                write_hf_files(reader, staging, dtype=dtype, adjust=adjust, **kwargs)
            finally:
                reader.close()
            shutil.rmtree(shards)
            commit_staging_dir(staging, out_dir)
        except Exception as exc:  # noqa: BLE001
            discard_staging_dir(staging)
            ok, detail = False, f"{type(exc).__name__}: {exc}"
    _all_ok(ok, detail)
    return out_dir


def mask_vocab_padding(logits_shard: torch.Tensor, vocab_size: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Vocab-parallel logits `[..., Vp/tp]` with the padded ids (>= `vocab_size`) pushed to the dtype's min.

    Megatron's output layer is padded to `Vp` rows (zeros here), so padded ids get logit 0 and would
    take probability mass in any softmax over the vocabulary (log-probs, entropy, sampling). The
    smallest finite value (not -inf) keeps entropy's p * log p at 0 instead of NaN.
    """
    per_rank = logits_shard.shape[-1]
    start = tp_rank * per_rank
    real = max(0, min(per_rank, vocab_size - start))
    if real == per_rank:
        return logits_shard
    padded = torch.arange(per_rank, device=logits_shard.device) >= real
    return logits_shard.masked_fill(padded, torch.finfo(logits_shard.dtype).min)
