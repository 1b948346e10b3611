"""LoRA adapters on megatron-core's own linear layers, at any tensor-parallel layout (issue 44, first step).

An adapter adds `scaling * B(A(x))` (scaling = alpha / rank) to a frozen linear layer's output, one adapter per
Hugging Face projection, as peft's LoRA places them on the transformers model: megatron's fused `linear_qkv`
carries three (q_proj, k_proj, v_proj), its fused `linear_fc1` two (gate_proj, up_proj), `linear_proj`
(o_proj) and `linear_fc2` (down_proj) one each. So an adapter here is a peft adapter exactly: the same
parameters, the same gradients, a PEFT adapter folder on export.

Sharding, with the layer's own tensor-parallel group:
- column-parallel layers (output split over TP): A `[r, in]` whole on every rank, B `[rows / TP, r]` the rank's
  rows of the projection (its query groups' q, k, v rows; its share of gate and up), its output placed where
  megatron's fused output keeps that projection (q, k and v interleaved per query group);
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

Not yet (issue 44): TransformerEngine's fused norm + linear (its input comes before the norm, which the adapter
must apply first), adapters on MoE experts (refused), the trainer's use of them.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# megatron's fused layers -> the Hugging Face projections they hold, in their output order
PROJECTIONS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
               "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
ROW_PARALLEL = {"linear_proj", "linear_fc2"}


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    modules: tuple[str, ...] = tuple(PROJECTIONS)  # megatron module names
    dropout: float = 0.0
    seed: int = 0  # A's initialisation: the same full matrix on every layout

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def _tag(param: nn.Parameter, *, split_dim: int | None, sequence_parallel: bool, expert: bool) -> None:
    if split_dim is not None:
        param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, split_dim, 1
    elif sequence_parallel:
        param.sequence_parallel = True
    if expert:
        param.allreduce = False  # megatron's DDP: reduced over the expert data-parallel group


def adapter_seed(seed: int, name: str) -> int:
    """The seed of one layer's adapters: its global name hashed (CRC-32), so no two layers share a draw."""
    import zlib

    return seed * 1_000_003 + zlib.crc32(name.encode())


def _kaiming_rows(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """peft's default for A (kaiming-uniform with a = sqrt(5)) on the full `[r, in]` matrix."""
    bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / 6) * sqrt(3 / fan_in)
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


ADAPTER_ATTR = "lora"  # the base layer's child that holds its adapters: `...linear_qkv.lora.lora_A.0`


class LoraAdapter(nn.Module):
    """The LoRA adapters of one frozen megatron linear layer (one per Hugging Face projection it holds).

    Attached to the layer as its `lora` child, with a forward hook that adds their output to the layer's: the
    layer and its parameters keep their names, so everything that reads the model by name (the weight table,
    the resharder, checkpoints, the HF export) sees the base model; the adapters are parameters beside it."""

    def __init__(self, base: nn.Module, module_name: str, settings: LoraSettings, *, rows: Sequence[int],
                 groups: int = 1, name: str = "", layer: int = 0) -> None:
        super().__init__()
        self.module_name = module_name
        self.settings = settings
        self.enabled = True
        self.row_parallel = module_name in ROW_PARALLEL
        self.projections = PROJECTIONS[module_name]
        self.groups = groups  # query groups on this rank (linear_qkv's interleaving)
        self.layer = layer  # the global (Hugging Face) layer index
        self.tp_group = base.tp_group
        self.tp, self.tp_rank = self.tp_group.size(), self.tp_group.rank()
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False))
        expert = bool(getattr(base, "is_expert", False))
        generator = torch.Generator().manual_seed(adapter_seed(settings.seed, name))
        r = settings.rank
        device = base.weight.device  # where the layer lives (its GPU); drawn on the host, the same on every layout
        self.lora_A = nn.ParameterList()
        self.lora_B = nn.ParameterList()
        for out_rows in rows:
            in_features = base.input_size
            full_a = _kaiming_rows((r, in_features), generator)
            if self.row_parallel:
                per = in_features // self.tp
                a = nn.Parameter(full_a[:, self.tp_rank * per:(self.tp_rank + 1) * per].contiguous().to(device))
                b = nn.Parameter(torch.zeros(out_rows, r).to(device))
                _tag(a, split_dim=1, sequence_parallel=False, expert=expert)
                _tag(b, split_dim=None, sequence_parallel=self.sequence_parallel, expert=expert)
            else:
                a = nn.Parameter(full_a.to(device))
                b = nn.Parameter(torch.zeros(out_rows // self.tp, r).to(device))
                _tag(a, split_dim=None, sequence_parallel=self.sequence_parallel, expert=expert)
                _tag(b, split_dim=0, sequence_parallel=False, expert=expert)
            self.lora_A.append(a)
            self.lora_B.append(b)
        for param in base.parameters(recurse=False):
            param.requires_grad_(False)

    def attach(self, base: nn.Module) -> None:
        setattr(base, ADAPTER_ATTR, self)
        base.register_forward_hook(self._add_to_output)

    def _add_to_output(self, _base: nn.Module, args: tuple[torch.Tensor, ...],
                       output: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.enabled:
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
        if self.row_parallel:  # x: this rank's input columns
            outs = []
            for a, b in zip(self.lora_A, self.lora_B):
                partial = F.linear(h, a)
                if self.tp > 1 and self.sequence_parallel:
                    summed = mappings.reduce_scatter_to_sequence_parallel_region(partial, group=group)
                elif self.tp > 1:
                    summed = mappings.reduce_from_tensor_model_parallel_region(partial, group=group)
                else:
                    summed = partial
                outs.append(F.linear(summed, b) * scaling)
            return outs[0]
        if self.tp > 1 and self.sequence_parallel:
            h = mappings.gather_from_sequence_parallel_region(h, group=group)
        outs = []
        for a, b in zip(self.lora_A, self.lora_B):
            low = F.linear(h, a)
            if self.tp > 1 and not self.sequence_parallel:
                low = mappings.copy_to_tensor_model_parallel_region(low, group=group)
            outs.append(F.linear(low, b) * scaling)
        return self._fused(outs, dim=-1)

    def _fused(self, parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        """The projections' parts placed along `dim` as megatron's fused layer holds its output there."""
        if self.module_name == "linear_qkv":  # per query group: [its q heads | k | v]
            dim = dim % parts[0].dim()
            lead, tail = parts[0].shape[:dim], parts[0].shape[dim + 1:]
            grouped = [p.reshape(*lead, self.groups, -1, *tail) for p in parts]
            return torch.cat(grouped, dim=dim + 1).reshape(*lead, -1, *tail)
        return torch.cat(list(parts), dim=dim)

    @torch.no_grad()
    def weight_delta(self) -> torch.Tensor:
        """scaling * B A as this rank's part of the base weight (fp32): what merging the adapters adds to it."""
        products = [b.float() @ a.float() for a, b in zip(self.lora_A, self.lora_B)]
        merged = products[0] if self.row_parallel else self._fused(products, dim=0)
        return merged * self.settings.scaling


def add_lora(model: nn.Module, settings: LoraSettings) -> list[LoraAdapter]:
    """Freeze a GPTModel chunk built by `models.bridge` and attach adapters to its target layers; the adapters, in
    layer order.
    Each adapter's A is drawn from its global layer and projection (`settings.seed`), so any layout holds the same
    adapters. A mixture-of-experts model is refused: adapters on experts are not built yet."""
    from hybridrl.models.bridge import chunk_info

    shape = chunk_info(model).source.shape
    if shape.is_moe:
        raise NotImplementedError("LoRA on a mixture-of-experts model is not built yet (issue 44)")
    rows = {"linear_qkv": (shape.num_attention_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim,
                           shape.num_kv_heads * shape.head_dim),
            "linear_proj": (shape.hidden_size,), "linear_fc1": (shape.ffn_hidden_size, shape.ffn_hidden_size),
            "linear_fc2": (shape.hidden_size,)}
    for param in model.parameters():  # the whole base is frozen: only the adapters train
        param.requires_grad_(False)
    attached = []
    for layer in model.decoder.layers:
        index = layer.layer_number - 1  # megatron numbers layers globally from 1
        for parent_name, leaf in (("self_attention", "linear_qkv"), ("self_attention", "linear_proj"),
                                  ("mlp", "linear_fc1"), ("mlp", "linear_fc2")):
            if leaf not in settings.modules:
                continue
            parent = getattr(layer, parent_name)
            base = getattr(parent, leaf)
            groups = shape.num_kv_heads // base.tp_group.size() if leaf == "linear_qkv" else 1
            adapter = LoraAdapter(base, leaf, settings, rows=rows[leaf], groups=groups,
                                  name=f"layers.{index}.{parent_name}.{leaf}", layer=index)
            adapter.attach(base)
            attached.append(adapter)
    return attached


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


# where peft keeps a projection's adapter on a Llama-like transformers model (`get_peft_model`), per layer
PEFT_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def peft_name(layer: int, projection: str, half: str) -> str:
    """peft's state-dict name of one adapter half (`half`: "lora_A" or "lora_B")."""
    return f"base_model.model.model.layers.{layer}.{PEFT_MODULE[projection]}.{projection}.{half}.weight"


def _halves(adapter: LoraAdapter) -> Iterator[tuple[str, nn.Parameter, int | None]]:
    """(peft's name, parameter, the dimension it is split along over TP or None) of each adapter half."""
    dim_a, dim_b = (1, None) if adapter.row_parallel else (None, 0)
    for projection, a, b in zip(adapter.projections, adapter.lora_A, adapter.lora_B, strict=True):
        yield peft_name(adapter.layer, projection, "lora_A"), a, dim_a
        yield peft_name(adapter.layer, projection, "lora_B"), b, dim_b


def lora_state(adapters: Sequence[LoraAdapter], *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every adapter half (or its gradient), whole, under peft's names: split halves gathered over each layer's TP
    group (a collective: every TP rank calls it, each gets the whole)."""
    import torch.distributed as dist

    out = {}
    for adapter in adapters:
        for name, param, dim in _halves(adapter):
            tensor = (param.grad if grads else param).detach()
            if dim is not None and adapter.tp > 1:
                parts = [torch.empty_like(tensor) for _ in range(adapter.tp)]
                dist.all_gather(parts, tensor.contiguous(), group=adapter.tp_group)
                tensor = torch.cat(parts, dim=dim)
            out[name] = tensor.cpu().clone()
    return out


@torch.no_grad()
def load_lora_state(adapters: Sequence[LoraAdapter], state: dict[str, torch.Tensor]) -> None:
    """Set every adapter half from whole tensors under peft's names (each rank takes its TP slice)."""
    for adapter in adapters:
        for name, param, dim in _halves(adapter):
            whole = state[name]
            if dim is not None:
                size = param.shape[dim]
                whole = whole.narrow(dim, adapter.tp_rank * size, size)
            if whole.shape != param.shape:
                raise ValueError(f"{name}: {tuple(whole.shape)} does not fit the adapter's {tuple(param.shape)} on "
                                 f"TP rank {adapter.tp_rank}")
            param.copy_(whole.to(param.device))


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


def save_peft_adapter(state: dict[str, torch.Tensor], settings: LoraSettings, folder: str | Path, *,
                      base_model: str = "", force: bool = False) -> Path:
    """A Hugging Face PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`) from `lora_state`'s
    whole tensors, which `peft.PeftModel.from_pretrained` loads onto the transformers model; written whole or not
    at all (a staging folder renamed into place)."""
    import json

    from safetensors.torch import save_file

    from hybridrl.persistence import atomic_dir

    targets = sorted({name.split(".")[-3] for name in state})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": settings.rank, "lora_alpha": settings.alpha, "lora_dropout": settings.dropout,
              "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "use_dora": False, "init_lora_weights": True, "inference_mode": True}
    with atomic_dir(folder, force=force) as staging:
        save_file({k: v.contiguous() for k, v in state.items()}, str(staging / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        (staging / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return Path(folder)
