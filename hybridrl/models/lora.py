"""LoRA adapters on megatron-core's own linear layers, at any tensor-parallel layout (issue 44).

An adapter adds `scaling * B(A(x))` (scaling = alpha / rank) to a frozen linear layer's output. Two kinds, in
verl's words (`lora_targets`): `canonical_lora`, one adapter per Hugging Face projection, as peft places them on
the transformers model (megatron's fused `linear_qkv` carries three, q_proj, k_proj, v_proj; its fused
`linear_fc1` two, gate_proj and up_proj; `linear_proj` (o_proj) and `linear_fc2` (down_proj) one each): the same
parameters and gradients as peft's; and `lora` (verl's default), one adapter per megatron layer, whose A the
layer's projections share: peft's with those A's equal (the same outputs; A's gradient the sum of theirs). Either
exports as a PEFT adapter folder.

Sharding, with the layer's own tensor-parallel group:
- column-parallel layers (output split over TP): A `[r, in]` whole on every rank, B `[rows / TP, r]` the rank's
  rows of the projection (its query groups' q, k, v rows; its share of gate and up), its output placed where
  megatron's fused output keeps that projection (q, k and v interleaved per query group; a fused adapter's B
  holds the layer's rows in that order already);
- row-parallel layers (input split): A `[r, in / TP]` the rank's input columns, B `[out, r]` whole; A's partial
  products are summed over TP (reduce-scattered along the sequence with sequence parallelism) before B.
A half held whole on every rank either gets the same gradient on each (without sequence parallelism: the
column case sums A's output gradient over TP first) or, with sequence parallelism, a partial one that megatron's
`finalize_model_grads` sums over TP (tagged `sequence_parallel`, as megatron tags its norms); a half split over
TP is tagged like megatron's own split weights (`tensor_model_parallel`), so the grad norm counts it once.

Why not peft's own `LoraParallelLinear` (peft/tuners/lora/tp_layer.py): it wraps only megatron's local linear
layers (not TransformerEngine's, which the GPU path builds), adapts a fused layer as one projection (a shared A
for q, k and v: not what peft does on the transformers model, so neither its gradients nor its export match),
and tags no parameter for megatron's gradient handling (wrong gradients under sequence parallelism).

A weight sync merges: the resharder reads an adapted layer's weight as W + scaling * B A (`MergedWeights`), so
vLLM serves the adapted model as plain weights through the usual resharding and proofs.

Mixture-of-experts models: every routed expert gets adapters of its own on its `linear_fc1` (gate and up, one A:
type `lora`) and `linear_fc2` (down), as peft's `target_parameters` puts one rank-r adapter per expert on the
transformers model's stacked expert weights. Under expert parallelism each rank holds its experts' adapters (drawn
from the expert's global index, so any layout holds the same ones). Split over expert TP (megatron's default: ETP =
TP) an expert's adapters are sharded like a dense layer's over its expert TP group (fc1's A whole on each rank, B
its rows; fc2's A its input columns, B whole), but reduce differently: megatron's token dispatcher, not the expert's
linear layers, gathers the expert's tokens over expert TP and sums its ranks' fc2 outputs and input gradients, so
each rank adds its own part of the adapter's output and only the gradient of the half held whole is summed over
expert TP (`LoraAdapter._expert_delta`). `lora_state` gathers the experts' halves over the expert TP x EP group.
The halves are tagged as megatron tags expert weights: reduced over the expert data-parallel group by DDP, never
summed over dense TP; the expert optimizer's grad norm counts a half split over expert TP on every rank, one held
whole on expert TP rank 0 alone (`_tag`). Their state's names are per expert, as the family's checkpoint names
the expert's weights (`...mlp.experts.{e}.gate_proj.lora_A.weight`, Mixtral's
`...block_sparse_moe.experts.{e}.w1.lora_A.weight`: peft's names on a transformers model whose experts are linear
layers), which peft itself converts when it loads a folder onto transformers 5's stacked experts (an expert's gate
and up adapters one of rank 2r on gate_up_proj).

On GPUs too the adapters' model is megatron's local layer spec (`device.layer_spec_kind`): TransformerEngine's fused
norm + linear takes its input before the norm, which an adapter would have to apply first. Not yet: adapters on
TE's layers, on shared experts or on grouped-GEMM experts, vLLM serving adapters on experts.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from hybridrl.models.arch import ModelShape
from hybridrl.models.lora_targets import (
    A_INIT_METHODS,
    PROJECTIONS,
    ROW_PARALLEL,
    adapted_projections,
    expert_hf_modules,
    peft_config_mismatches,
    peft_name,
)


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    kind: str = "lora"  # `lora_targets.LORA_TYPES`: one adapter per megatron layer, or per HF projection
    targets: tuple[str, ...] = tuple(PROJECTIONS)  # the kind's target names (`lora_targets.TARGETS`)
    dropout: float = 0.0  # on the adapter's input (verl's dropout_position "pre")
    a_init: str = "kaiming"  # `lora_targets.A_INIT_METHODS`
    seed: int = 0  # A's initialisation: the same full matrix on every layout

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def projections(self) -> frozenset[str]:
        return adapted_projections(self.kind, self.targets)


def _tag(param: nn.Parameter, *, split_dim: int | None, sequence_parallel: bool, expert: bool,
         expert_tp_rank: int = 0) -> None:
    """megatron's attributes for an adapter half: how DDP, `finalize_model_grads` and the grad norm treat it.
    `split_dim`: the half is split over the layer's TP group along it (a routed expert's: over expert TP)."""
    if split_dim is not None:
        param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, split_dim, 1
    elif expert and expert_tp_rank == 0:
        # a routed expert's half held whole on each of its expert TP ranks (on its one rank at expert TP 1), counted in
        # the grad norm on expert TP rank 0 alone. The expert optimizer sums its norm over the expert TP x EP x PP
        # group but counts an untagged parameter on dense TP rank 0 only (its `tp_group` is the dense one), which is
        # not expert TP rank 0 when expert TP and TP differ: tagged as split, it is counted here whatever the dense TP
        # rank. Never sequence-parallel: nothing of it is summed over dense TP
        param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
    elif expert:
        # its copy on another expert TP rank (the same values and, summed over expert TP, the same gradient): megatron's
        # `shared` (a parameter another rank counts, as the tied output layer's) keeps it out of the grad norm
        param.shared = True
    elif sequence_parallel:
        param.sequence_parallel = True
    if expert:
        param.allreduce = False  # megatron's DDP: reduced over the expert data-parallel group


def adapter_seed(seed: int, name: str) -> int:
    """The seed of one layer's adapters: its global name hashed (CRC-32), so no two layers share a draw."""
    import zlib

    return seed * 1_000_003 + zlib.crc32(name.encode())


def _initial_a(shape: tuple[int, int], method: str, generator: torch.Generator) -> torch.Tensor:
    """A's first values on the full `[r, in]` matrix: Megatron-Bridge's `kaiming` (kaiming_uniform_ with
    a = sqrt(5), also peft's default) or `xavier` (xavier_uniform_)."""
    rank, fan_in = shape
    if method == "kaiming":
        bound = 1.0 / math.sqrt(fan_in)  # gain sqrt(2 / 6) * sqrt(3 / fan_in)
    elif method == "xavier":
        bound = math.sqrt(6.0 / (fan_in + rank))
    else:
        raise ValueError(f"lora_A_init_method={method!r}; expected one of {A_INIT_METHODS}")
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


ADAPTER_ATTR = "lora"  # the base layer's child that holds its adapters: `...linear_qkv.lora.lora_A.0`


class LoraAdapter(nn.Module):
    """The LoRA adapters of one frozen megatron linear layer: one (`lora`) or one per adapted Hugging Face
    projection it holds (`canonical_lora`); each is a "part" here, `parts[i]` the projections adapter i covers.

    Attached to the layer as its `lora` child, with a forward hook that adds their output to the layer's: the
    layer and its parameters keep their names, so everything that reads the model by name (the weight table,
    the resharder, checkpoints, the HF export) sees the base model; the adapters are parameters beside it."""

    def __init__(self, base: nn.Module, module_name: str, settings: LoraSettings, *, rows: Sequence[int],
                 groups: int = 1, name: str = "", layer: int = 0, expert: int | None = None,
                 expert_group: ProcessGroup | None = None, hf_modules: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.module_name = module_name
        self.settings = settings
        self.enabled = True
        self.row_parallel = module_name in ROW_PARALLEL
        self.projections = PROJECTIONS[module_name]
        self.groups = groups  # query groups on this rank (linear_qkv's interleaving)
        self.layer = layer  # the global (Hugging Face) layer index
        self.expert = expert  # a routed expert's global index (None: a dense layer)
        # a routed expert's: the group its layer's experts are spread over, megatron's expert TP x EP group (None: each
        # expert whole on every rank)
        self.expert_group = expert_group
        # a routed expert's Hugging Face module of each projection (`model.layers.0.mlp.experts.3.gate_proj`):
        # peft's names for its adapters (None: the dense layer's, `peft_name`)
        self.hf_modules = dict(hf_modules) if hf_modules is not None else None
        self.tp_group = base.tp_group  # a routed expert's layer holds megatron's expert TP group
        self.tp, self.tp_rank = self.tp_group.size(), self.tp_group.rank()
        # an expert's linear sees the tokens the dispatcher sent it, not a sequence shard (megatron's expert
        # RowParallelLinear keeps the config's flag all the same)
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) and expert is None
        # each projection's output rows on this rank (a column-parallel layer's are split over TP)
        self.local_rows = {p: n if self.row_parallel else n // self.tp for p, n in zip(self.projections, rows)}
        adapted = [p for p in self.projections if p in settings.projections]
        fused = settings.kind == "lora"
        self.parts: tuple[tuple[str, ...], ...] = (tuple(adapted),) if fused and adapted else tuple(
            (p,) for p in adapted)
        is_expert = bool(getattr(base, "is_expert", False))
        generator = torch.Generator().manual_seed(adapter_seed(settings.seed, name))
        r = settings.rank
        device = base.weight.device  # where the layer lives (its GPU); drawn on the host, the same on every layout
        in_features = base.input_size
        # canonical: one draw per projection of the layer in order, adapted or not (the same A whatever the targets)
        draws = {p: _initial_a((r, in_features), settings.a_init, generator) for p in
                 (self.projections if not fused else self.projections[:1])}
        self.lora_A = nn.ParameterList()
        self.lora_B = nn.ParameterList()
        for part in self.parts:
            full_a = draws[part[0]] if not fused else draws[self.projections[0]]
            out_rows = sum(self.local_rows[p] for p in part)
            if self.row_parallel:
                per = in_features // self.tp
                a = nn.Parameter(full_a[:, self.tp_rank * per:(self.tp_rank + 1) * per].contiguous().to(device))
                b = nn.Parameter(torch.zeros(out_rows, r).to(device))
                _tag(a, split_dim=1, sequence_parallel=False, expert=is_expert)
                _tag(b, split_dim=None, sequence_parallel=self.sequence_parallel, expert=is_expert,
                     expert_tp_rank=self.tp_rank)
            else:
                a = nn.Parameter(full_a.to(device))
                b = nn.Parameter(torch.zeros(out_rows, r).to(device))
                _tag(a, split_dim=None, sequence_parallel=self.sequence_parallel, expert=is_expert,
                     expert_tp_rank=self.tp_rank)
                _tag(b, split_dim=0, sequence_parallel=False, expert=is_expert)
            self.lora_A.append(a)
            self.lora_B.append(b)
        for param in base.parameters(recurse=False):
            param.requires_grad_(False)

    def peft_name(self, projection: str, half: str) -> str:
        """peft's state-dict name of one of this adapter's halves (`half`: "lora_A" or "lora_B")."""
        if self.hf_modules is not None:
            return f"base_model.model.{self.hf_modules[projection]}.{half}.weight"
        return peft_name(self.layer, projection, half)

    def attach(self, base: nn.Module) -> None:
        setattr(base, ADAPTER_ATTR, self)
        base.register_forward_hook(self._add_to_output)

    def _add_to_output(self, _base: nn.Module, args: tuple[torch.Tensor, ...],
                       output: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.enabled or not self.parts:
            return output
        out, bias = output
        return out + self.delta(args[0]).to(out.dtype), bias

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        group = self.tp_group
        scaling = self.settings.scaling
        h = x.float()
        if self.settings.dropout:
            h = F.dropout(h, self.settings.dropout, self.training)
        if self.expert is not None:
            return self._expert_delta(h)
        if self.row_parallel:  # x: this rank's input columns; one projection
            (a,), (b,) = self.lora_A, self.lora_B
            partial = F.linear(h, a)
            if self.tp > 1 and self.sequence_parallel:
                summed = mappings.reduce_scatter_to_sequence_parallel_region(partial, group=group)
            elif self.tp > 1:
                summed = mappings.reduce_from_tensor_model_parallel_region(partial, group=group)
            else:
                summed = partial
            return F.linear(summed, b) * scaling
        if self.tp > 1 and self.sequence_parallel:
            h = mappings.gather_from_sequence_parallel_region(h, group=group)
        outs = {}
        for part, a, b in zip(self.parts, self.lora_A, self.lora_B):
            low = F.linear(h, a)
            if self.tp > 1 and not self.sequence_parallel:
                low = mappings.copy_to_tensor_model_parallel_region(low, group=group)
            outs[part] = F.linear(low, b) * scaling
        return self._layer_rows(outs, dim=-1)

    def _expert_delta(self, h: torch.Tensor) -> torch.Tensor:
        """A routed expert's adapter output: this rank's part of it, as its base layer's output is.

        At expert TP > 1 megatron's alltoall dispatcher, not the expert's linear layers, does the expert's reductions
        (`MoEAlltoAllTokenDispatcher`): it gathers the expert's tokens over the expert TP group (every rank of it sees
        them all; the backward reduce-scatter sums the ranks' input gradients), and reduce-scatters (sums) the
        ranks' linear_fc2 outputs. So the adapter reduces only what the dispatcher does not:
        - linear_fc1 (column-parallel: A whole, B this rank's rows): B_r (A x). The input's gradient A^T B_r^T g_r
          stays this rank's part of the sum the dispatcher takes; A's is the sum over expert TP of each rank's part,
          summed by passing A through `copy_to_tensor_model_parallel_region` (identity forward, all-reduce backward).
          The dense layers' all-reduce of A x's gradient instead would put the whole input gradient on every rank,
          which the dispatcher would then count expert TP times.
        - linear_fc2 (row-parallel: A this rank's input columns, B whole): B (A_r x_r), this rank's part of the sum the
          combine takes (summing A_r x_r over expert TP first, as the dense layers do, would count the adapter expert
          TP times). B's gradient is the sum over expert TP of g (A_r x_r)^T: B passed through the same function.
        The halves held whole on each expert TP rank start equal (drawn from the expert's global index) and get the
        same summed gradient, so they stay equal."""
        from megatron.core.tensor_parallel import mappings

        outs = {}
        for part, a, b in zip(self.parts, self.lora_A, self.lora_B):
            if self.tp > 1 and self.row_parallel:
                b = mappings.copy_to_tensor_model_parallel_region(b, group=self.tp_group)
            elif self.tp > 1:
                a = mappings.copy_to_tensor_model_parallel_region(a, group=self.tp_group)
            outs[part] = F.linear(F.linear(h, a), b) * self.settings.scaling
        return self._layer_rows(outs, dim=-1)

    def _layer_rows(self, by_part: dict[tuple[str, ...], torch.Tensor], dim: int) -> torch.Tensor:
        """The parts' rows (along `dim`) placed as the layer holds its output on this rank; zeros for a projection
        no part adapts. A fused part is already in the layer's order."""
        if len(self.parts) == 1 and self.parts[0] == self.projections:
            return by_part[self.parts[0]]
        per_projection = {part[0]: t for part, t in by_part.items()}
        sample = next(iter(by_part.values()))
        parts = []
        for p in self.projections:
            if p in per_projection:
                parts.append(per_projection[p])
            else:
                shape = list(sample.shape)
                shape[dim] = self.local_rows[p]
                parts.append(sample.new_zeros(shape))
        return self._fused(parts, dim)

    def _fused(self, parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        """The projections' parts placed along `dim` as megatron's fused layer holds its output there."""
        if self.module_name == "linear_qkv":  # per query group: [its q heads | k | v]
            dim = dim % parts[0].dim()
            lead, tail = parts[0].shape[:dim], parts[0].shape[dim + 1:]
            grouped = [p.reshape(*lead, self.groups, -1, *tail) for p in parts]
            return torch.cat(grouped, dim=dim + 1).reshape(*lead, -1, *tail)
        return torch.cat(list(parts), dim=dim)

    def _split_rows(self, part: tuple[str, ...], tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """A part's B (rows in the layer's order) as each projection's rows: `_fused` undone."""
        if len(part) == 1:
            return {part[0]: tensor}
        sizes = [self.local_rows[p] for p in part]
        if self.module_name == "linear_qkv":
            grouped = tensor.reshape(self.groups, -1, *tensor.shape[1:])
            pieces = grouped.split([s // self.groups for s in sizes], dim=1)
            return {p: piece.reshape(-1, *tensor.shape[1:]) for p, piece in zip(part, pieces)}
        return dict(zip(part, tensor.split(sizes, dim=0)))

    @torch.no_grad()
    def weight_delta(self) -> torch.Tensor:
        """scaling * B A as this rank's part of the base weight (fp32): what merging the adapters adds to it."""
        products = {part: b.float() @ a.float() for part, a, b in zip(self.parts, self.lora_A, self.lora_B)}
        return self._layer_rows(products, dim=0) * self.settings.scaling


def _input_requires_grad(_embedding: nn.Module, _args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    """The frozen embedding's output marked as needing a gradient (transformers' `enable_input_require_grads`, which
    peft's adapters rely on under gradient checkpointing). megatron's activation recompute
    (`tensor_parallel.checkpoint`, a reentrant autograd Function) runs its layers' backward only if one of its
    inputs needs a gradient: with the base frozen, the first stage's layers get none, so without this their
    adapters (every adapter at PP 1) would get no gradient at all and never train."""
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)


def add_lora(model: nn.Module, settings: LoraSettings) -> list[LoraAdapter]:
    """Freeze a GPTModel chunk built by `models.bridge` and attach adapters to its target layers (an MoE layer's:
    each of this rank's routed experts'); the adapters, in layer order.
    Each adapter's A is drawn from its global layer, expert and projection (`settings.seed`), so any layout holds the
    same adapters."""
    from hybridrl.models.bridge import chunk_info

    info = chunk_info(model)
    shape = info.source.shape
    rows = {"linear_qkv": (shape.num_attention_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim,
                           shape.num_kv_heads * shape.head_dim),
            "linear_proj": (shape.hidden_size,), "linear_fc1": (shape.ffn_hidden_size, shape.ffn_hidden_size),
            "linear_fc2": (shape.hidden_size,)}
    for param in model.parameters():  # the whole base is frozen: only the adapters train
        param.requires_grad_(False)
    embedding = getattr(model, "embedding", None)  # the first pipeline stage's
    if embedding is not None and model.config.recompute_granularity is not None:
        embedding.register_forward_hook(_input_requires_grad)
    attached = []
    for layer in model.decoder.layers:
        index = layer.layer_number - 1  # megatron numbers layers globally from 1
        for parent_name, leaf in (("self_attention", "linear_qkv"), ("self_attention", "linear_proj"),
                                  ("mlp", "linear_fc1"), ("mlp", "linear_fc2")):
            if not settings.projections & set(PROJECTIONS[leaf]):
                continue
            parent = getattr(layer, parent_name)
            if parent_name == "mlp" and hasattr(parent, "experts"):
                attached += _expert_adapters(parent, leaf, settings, shape, index, info.ep_rank)
                continue
            base = getattr(parent, leaf)
            groups = shape.num_kv_heads // base.tp_group.size() if leaf == "linear_qkv" else 1
            adapter = LoraAdapter(base, leaf, settings, rows=rows[leaf], groups=groups,
                                  name=f"layers.{index}.{parent_name}.{leaf}", layer=index)
            adapter.attach(base)
            attached.append(adapter)
    return attached


def _expert_adapters(moe: nn.Module, leaf: str, settings: LoraSettings, shape: ModelShape, layer: int,
                     ep_rank: int) -> list[LoraAdapter]:
    """One adapter on `leaf` of each of this rank's routed experts (megatron's SequentialMLP: `local_experts`), under
    the expert's global index (EP rank x experts per rank + local index); at expert TP > 1 on this rank's part of the
    expert (its base layer's expert TP group)."""
    from megatron.core import parallel_state as megatron_state

    local = getattr(moe.experts, "local_experts", None)
    if local is None:
        raise NotImplementedError(f"layer {layer}: adapters on {type(moe.experts).__name__} (grouped GEMM experts) "
                                  "are not built; the local spec's SequentialMLP is")
    if getattr(moe, "shared_experts", None) is not None:
        raise NotImplementedError(f"layer {layer}: adapters on shared experts are not built")
    if settings.kind != "lora":
        raise ValueError("adapters on experts are of type lora (gate and up share one A, as peft's adapter on the "
                         f"stacked gate_up_proj does); got {settings.kind}")
    rows = (shape.moe_ffn_hidden_size, shape.moe_ffn_hidden_size) if leaf == "linear_fc1" else (shape.hidden_size,)
    spread = megatron_state.get_expert_tensor_and_model_parallel_group()  # expert TP x EP
    expert_group = spread if spread.size() > 1 else None
    out = []
    for local_index, expert in enumerate(local):
        base = getattr(expert, leaf)
        index = ep_rank * len(local) + local_index
        adapter = LoraAdapter(base, leaf, settings, rows=rows, name=f"layers.{layer}.mlp.experts.{index}.{leaf}",
                              layer=layer, expert=index, expert_group=expert_group,
                              hf_modules=expert_hf_modules(shape, leaf, layer, index))
        adapter.attach(base)
        out.append(adapter)
    return out


def lora_adapters(models: Sequence[nn.Module]) -> list[LoraAdapter]:
    return [m for model in models for m in model.modules() if isinstance(m, LoraAdapter)]


class MergedWeights(Mapping[str, torch.Tensor]):
    """A chunk's tensors by name (`bridge.chunk_tensors`) with each adapted layer's weight read as
    W + scaling * B A, in W's dtype: what a merged sync sends, so that vLLM serves the adapted model as plain
    weights. Computed when read, not kept: a sync reads one tensor's pieces one after another, so only the last
    merged weight is cached (keyed by the version counters of it and its adapters, which an optimizer step moves)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], adapters: Mapping[str, LoraAdapter]) -> None:
        self._tensors, self._adapters = tensors, adapters
        self._last: tuple[tuple, torch.Tensor] | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        adapter = self._adapters.get(name)
        if adapter is None:
            return self._tensors[name]
        weight = self._tensors[name]
        key = (name, weight._version, *(p._version for p in adapter.parameters()))
        if self._last is None or self._last[0] != key:
            merged = (weight.float() + adapter.weight_delta().to(weight.device)).to(weight.dtype)
            self._last = (key, merged)
        return self._last[1]

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def merged_weights(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """`tensors` of an unwrapped chunk as `MergedWeights` when it has adapters; else `tensors` itself."""
    adapters = {f"{name}.weight": module.get_submodule(ADAPTER_ATTR) for name, module in model.named_modules()
                if isinstance(getattr(module, ADAPTER_ATTR, None), LoraAdapter)}
    missing = sorted(set(adapters) - set(tensors))
    if missing:
        raise KeyError(f"adapted weights {missing[:3]} are not among the chunk's tensors")
    return MergedWeights(tensors, adapters) if adapters else tensors




def _halves(adapter: LoraAdapter) -> Iterator[tuple[str, nn.Parameter, int | None,
                                                     Callable[[torch.Tensor], torch.Tensor]]]:
    """(peft's name, the adapter parameter it is read from, the dimension it is split along over TP or None, how to
    cut it from a tensor shaped like that parameter: its gradient, its optimizer state) of each projection's adapter
    halves. A fused adapter gives each of its projections its A and that projection's rows of B."""
    dim_a, dim_b = (1, None) if adapter.row_parallel else (None, 0)
    for part, a, b in zip(adapter.parts, adapter.lora_A, adapter.lora_B, strict=True):
        for projection in part:
            yield adapter.peft_name(projection, "lora_A"), a, dim_a, _itself
            yield adapter.peft_name(projection, "lora_B"), b, dim_b, partial(_projection_rows, adapter, part,
                                                                             projection)


def _projection_rows(adapter: LoraAdapter, part: tuple[str, ...], projection: str, b: torch.Tensor) -> torch.Tensor:
    return adapter._split_rows(part, b)[projection]


def _itself(param: torch.Tensor) -> torch.Tensor:
    return param


def _gathered_over(adapter: LoraAdapter) -> ProcessGroup:
    """The group `lora_state` gathers an adapter's halves over to make them whole: a routed expert's expert TP x EP
    group, else its TP group."""
    return adapter.expert_group if adapter.expert_group is not None else adapter.tp_group


def reaches(adapter: LoraAdapter, root: int) -> bool:
    """Whether `lora_state(..., root=root)` can gather `adapter` to the global rank `root`: `root` is in the group its
    halves are gathered over."""
    import torch.distributed as dist

    return root in dist.get_process_group_ranks(_gathered_over(adapter))


def _sent_by_expert_rank(adapter: LoraAdapter, dim: int | None) -> bool:
    """Whether this rank gives a routed expert's half to its gather over expert TP x EP: its part of a half split over
    expert TP; a half every expert TP rank holds whole, from expert TP rank 0 alone (the others' are copies)."""
    return (dim is not None and adapter.tp > 1) or adapter.tp_rank == 0


def _read_for_root(adapter: LoraAdapter, dim: int | None, root: int, me: int) -> bool:
    """In a gather to `root`: whether rank `me` reads a half. A routed expert's: the halves it gives the gather
    (`_sent_by_expert_rank`), the root's too. A dense layer's: the root reads every half it holds (the whole is
    assembled there); another rank only its part of a half split over TP (one every TP rank holds whole is the root's
    own copy already)."""
    if adapter.expert_group is not None:
        return _sent_by_expert_rank(adapter, dim)
    return me == root or (dim is not None and adapter.tp > 1)


def parameters_read_for_root(adapters: Sequence[LoraAdapter], root: int) -> list[nn.Parameter]:
    """The adapter parameters whose `of(param)` `lora_state(adapters, root=root)` reads on this rank: those whose
    state must be here, whole (a distributed optimizer's shards gathered), for the gather to `root`."""
    import torch.distributed as dist

    me = dist.get_rank()
    read: dict[int, nn.Parameter] = {}
    for adapter in adapters:
        for _, param, dim, _ in _halves(adapter):
            if _read_for_root(adapter, dim, root, me):
                read.setdefault(id(param), param)
    return list(read.values())


def lora_state(adapters: Sequence[LoraAdapter], *, grads: bool = False,
               of: Callable[[nn.Parameter], torch.Tensor] | None = None,
               root: int | None = None) -> dict[str, torch.Tensor]:
    """Every adapter half (its gradient with `grads`; `of(param)` of it, e.g. an optimizer moment), whole, under
    peft's names: a dense layer's split halves gathered over its TP group, routed experts' halves over their expert
    TP x EP group (a collective: every rank of each of those groups calls it with its adapters, each gets the whole).

    `root` (a global rank in each adapter's group, `reaches`): the whole on `root` alone, the other ranks send their
    parts (`of` read only for those, `parameters_read_for_root`) and get nothing (an empty dict): what one writer
    needs, without every rank holding every expert's state."""
    import torch.distributed as dist

    from hybridrl.parallel.device import collective_device

    pick = of or ((lambda p: p.grad) if grads else _itself)
    me = dist.get_rank() if root is not None else -1
    if root is not None:
        strays = [adapter.peft_name(adapter.projections[0], "lora_A") for adapter in adapters
                  if not reaches(adapter, root)]
        if strays:
            raise ValueError(f"cannot gather {strays[:2]} to rank {root}: not in the group they are gathered over")
    out = {}
    # the routed experts' pieces this rank gives, by the expert TP x EP group they are gathered over
    by_expert_group: dict[ProcessGroup, list[_ExpertPiece]] = {}
    for adapter in adapters:
        read: dict[int, torch.Tensor] = {}  # `of` once per parameter (a fused adapter's A serves each projection)
        for name, param, dim, cut in _halves(adapter):
            if root is not None and not _read_for_root(adapter, dim, root, me):
                continue
            if adapter.expert_group is not None and not _sent_by_expert_rank(adapter, dim):
                continue  # a copy of what expert TP rank 0 gives
            if id(param) not in read:
                read[id(param)] = pick(param).detach()
            tensor = cut(read[id(param)])
            split = dim is not None and adapter.tp > 1
            if adapter.expert_group is not None:
                piece = _ExpertPiece(name, adapter.tp_rank if split else 0, adapter.tp if split else 1, dim,
                                     tensor.cpu().clone())
                by_expert_group.setdefault(adapter.expert_group, []).append(piece)
                continue
            if split:  # `of` may give host tensors (a checkpoint's gathered state)
                tensor = tensor.contiguous().to(collective_device(adapter.tp_group))
                if root is None:
                    parts = [torch.empty_like(tensor) for _ in range(adapter.tp)]
                    dist.all_gather(parts, tensor, group=adapter.tp_group)
                else:
                    gathered = [torch.empty_like(tensor) for _ in range(adapter.tp)] if me == root else None
                    dist.gather(tensor, gathered, dst=root, group=adapter.tp_group)
                    if gathered is None:  # sent
                        continue
                    parts = gathered
                tensor = torch.cat(parts, dim=dim)
            out[name] = tensor.cpu().clone()
    for group, mine in by_expert_group.items():  # every rank's experts (names carry the global expert index)
        everyone: list[list[_ExpertPiece] | None] | None
        if root is None:
            everyone = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, mine, group=group)
        else:
            everyone = [None] * dist.get_world_size(group) if me == root else None
            dist.gather_object(mine, everyone, dst=root, group=group)
        if everyone is not None:  # nothing on a rank that only sent
            out.update(_whole_expert_halves(everyone))
    if by_expert_group:  # the experts came last: back to one order on every rank, by layer, then expert, then name
        out = dict(sorted(out.items(), key=lambda item: _state_order(item[0])))
    return out


@dataclass(frozen=True)
class _ExpertPiece:
    """What one rank gives `lora_state`'s gather of a routed expert's half: its part `part` of `parts` (along `dim`
    over expert TP; the whole half when `parts` is 1)."""

    name: str
    part: int
    parts: int
    dim: int | None
    tensor: torch.Tensor


def _whole_expert_halves(everyone: Sequence[Sequence[_ExpertPiece] | None]) -> dict[str, torch.Tensor]:
    """Each expert half whole from the pieces every rank of its expert TP x EP group gave: a split half's parts
    concatenated in expert TP order."""
    by_name: dict[str, dict[int, _ExpertPiece]] = {}
    for theirs in everyone:
        if theirs is None:
            raise RuntimeError("a rank of the expert TP x EP group gave no expert adapters to the gather")
        for piece in theirs:
            by_name.setdefault(piece.name, {})[piece.part] = piece
    out = {}
    for name, pieces in by_name.items():
        first = next(iter(pieces.values()))
        if sorted(pieces) != list(range(first.parts)):
            raise RuntimeError(f"{name}: the gather over expert TP x EP got parts {sorted(pieces)} of {first.parts}")
        out[name] = first.tensor if first.parts == 1 else torch.cat([pieces[i].tensor for i in range(first.parts)],
                                                                      dim=first.dim)
    return out


def _state_order(name: str) -> tuple[int, int, str]:
    """The whole state in layer order, a layer's experts by their global index (as one rank's would be)."""
    parts = name.split(".")
    layer = int(parts[parts.index("layers") + 1])
    expert = int(parts[parts.index("experts") + 1]) if "experts" in parts else -1
    return layer, expert, name


def local_lora_tensors(adapters: Sequence[LoraAdapter], state: Mapping[str, torch.Tensor]
                       ) -> dict[nn.Parameter, torch.Tensor]:
    """This rank's part of each adapter parameter from whole tensors under peft's names (its TP slice; a fused
    adapter's B assembled from its projections' rows). A fused adapter needs its projections' A to be one matrix
    (as it exports them)."""
    out: dict[nn.Parameter, torch.Tensor] = {}
    for adapter in adapters:
        for part, a, b in zip(adapter.parts, adapter.lora_A, adapter.lora_B, strict=True):
            names_a = [adapter.peft_name(p, "lora_A") for p in part]
            missing = [n for p in part for n in (adapter.peft_name(p, "lora_A"), adapter.peft_name(p, "lora_B"))
                       if n not in state]
            if missing:
                raise KeyError(f"the adapter state lacks {missing[:2]} (its targets differ from this model's)")
            whole_a = state[names_a[0]]
            if any(not torch.equal(state[n], whole_a) for n in names_a[1:]):
                raise ValueError(f"{names_a}: one fused adapter (type lora) holds one A for {list(part)}, but these "
                                 "differ: the state was trained with an A per projection (type canonical_lora)")
            if adapter.row_parallel:
                whole_a = whole_a.narrow(1, adapter.tp_rank * a.shape[1], a.shape[1])
            rows = {}
            for p in part:
                whole_b = state[adapter.peft_name(p, "lora_B")]
                size = adapter.local_rows[p]
                rows[p] = whole_b if adapter.row_parallel else whole_b.narrow(0, adapter.tp_rank * size, size)
            local_b = rows[part[0]] if len(part) == 1 else adapter._fused([rows[p] for p in part], dim=0)
            for name, local, param in ((names_a[0], whole_a, a),
                                       (adapter.peft_name(part[0], "lora_B"), local_b, b)):
                if local.shape != param.shape:
                    raise ValueError(f"{name}: {tuple(local.shape)} does not fit the adapter's {tuple(param.shape)} "
                                     f"on TP rank {adapter.tp_rank}")
                out[param] = local
    return out


@torch.no_grad()
def load_lora_state(adapters: Sequence[LoraAdapter], state: Mapping[str, torch.Tensor]) -> None:
    """Set every adapter half from whole tensors under peft's names (each rank takes its TP slice)."""
    for param, local in local_lora_tensors(adapters, state).items():
        param.copy_(local.to(param.device))


@contextmanager
def adapters_disabled(models: Sequence[nn.Module]) -> Iterator[None]:
    """The base model alone while active (the reference policy of a LoRA actor)."""
    adapters = lora_adapters(models)
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True


def peft_adapter_files(state: dict[str, torch.Tensor], settings: LoraSettings, *,
                       base_model: str = "") -> dict[str, bytes]:
    """A Hugging Face PEFT adapter folder's files (`adapter_config.json`, `adapter_model.safetensors`) from
    `lora_state`'s whole tensors, as bytes: what `save_peft_adapter` writes, and what a disaggregated sync ships to
    the rollout pool."""
    import json

    from safetensors.torch import save

    targets = sorted({name.split(".")[-3] for name in state})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": settings.rank, "lora_alpha": settings.alpha, "lora_dropout": settings.dropout,
              "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "use_dora": False, "init_lora_weights": True, "inference_mode": True}
    return {"adapter_model.safetensors": save({k: v.contiguous() for k, v in state.items()}, metadata={"format": "pt"}),
            "adapter_config.json": (json.dumps(config, indent=2) + "\n").encode()}


def save_peft_adapter(state: dict[str, torch.Tensor], settings: LoraSettings, folder: str | Path, *,
                      base_model: str = "", force: bool = False) -> Path:
    """A Hugging Face PEFT adapter folder (`peft_adapter_files`), which `peft.PeftModel.from_pretrained` loads onto the
    transformers model; written whole or not at all."""
    from hybridrl.persistence import write_folder

    return write_folder(peft_adapter_files(state, settings, base_model=base_model), folder, force=force)


def _read_peft_folder(folder: Path) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """A PEFT adapter folder's adapter_config.json and its tensors under peft's names."""
    import json

    from safetensors.torch import load_file

    return (json.loads((folder / "adapter_config.json").read_text()),
            load_file(str(folder / "adapter_model.safetensors")))


def read_peft_adapter(folder: str | Path, settings: LoraSettings) -> dict[str, torch.Tensor]:
    """A PEFT adapter folder's tensors under peft's names, for `load_lora_state`, after checking that its rank and
    alpha are the settings' (`hybridrl plan` checks them too; this guards callers that skip it)."""
    folder = Path(folder)
    config, tensors = _read_peft_folder(folder)
    differ = [f"the adapter's {key}={theirs!r} differs from actor_rollout_ref.model.lora.{name}="
              f"{getattr(settings, name)!r}" for name, key, theirs in peft_config_mismatches(config, settings.rank,
                                                                                                settings.alpha)]
    if differ:
        raise ValueError(f"{folder}: {'; '.join(differ)}; set them to the adapter's")
    return tensors


@dataclass(frozen=True)
class PeftMerge:
    """A PEFT adapter folder as a merge of each adapted HF weight: W + (alpha / r) B A, computed in fp32 and returned
    in W's dtype, as peft's `merge_and_unload` does; every other weight unchanged. `weights`: the HF names it
    adapts."""

    scaling: float
    halves: dict[str, tuple[torch.Tensor, torch.Tensor]]  # HF weight name -> (A, B)

    @classmethod
    def read(cls, folder: str | Path) -> PeftMerge:
        config, tensors = _read_peft_folder(Path(folder))
        return cls.of(tensors, float(config["lora_alpha"]) / int(config["r"]))

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor], scaling: float) -> PeftMerge:
        """The merge of whole adapter tensors under peft's names (`lora_state`'s, a PEFT folder's)."""
        halves = {name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight"):
                  (a, state[name.replace(".lora_A.", ".lora_B.")])
                  for name, a in state.items() if name.endswith(".lora_A.weight")}
        return cls(scaling, halves)

    @property
    def weights(self) -> list[str]:
        return sorted(self.halves)

    def __call__(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        pair = self.halves.get(name)
        if pair is None:
            return weight
        a, b = pair
        return (weight.float() + self.scaling * (b.float() @ a.float())).to(weight.dtype)
