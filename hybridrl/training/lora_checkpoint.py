"""A LoRA actor's part of a role checkpoint (`checkpointing.py`): its adapters and their optimizer state.

The base is frozen, so the role's trained state is the adapters alone: each pipeline stage's adapters and Adam's
moments of them, whole (gathered over TP, an MoE model's routed experts' over expert TP x EP, and the distributed
optimizer's shards over the group megatron sharded them over: DP x CP for the dense adapters, the expert
data-parallel group for the experts') under peft's names, in one safetensors file per stage
(`lora_state_pp000.safetensors`: `weight/<name>`, `exp_avg/<name>`, ...), written by the stage's first holder (DP
and CP rank 0, TP rank 0). Only that writer holds the whole; the ranks that feed it hold their own part, the others
nothing (every expert's weights and moments on every rank came to ~9 GB of host memory per rank for Qwen3-30B-A3B
at r 16). Read back on any layout: each rank takes its adapters' slices of the whole tensors
(`lora.local_lora_tensors`), its optimizer shard of them (over either group) through the same `load_optimizer` as a
full model's. Rank 0 also writes the checkpoint's `lora/` folder: the adapters as a Hugging Face PEFT adapter
(`peft.PeftModel.from_pretrained` loads it onto the transformers model).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.models.lora import (
    LoraAdapter,
    LoraSettings,
    load_lora_state,
    local_lora_tensors,
    lora_adapters,
    lora_state,
    parameters_read_for_root,
    reaches,
    save_peft_adapter,
)
from hybridrl.persistence import RoleCheckpointError, file_sha256, save_safetensors
from hybridrl.training.backend import MegatronBackend
from hybridrl.training.optimizer_state import (
    OptimizerView,
    agreed_summaries,
    gather_sharded,
    load_optimizer,
    local_optimizer_state,
    optimizer_summary,
)
from hybridrl.training.train_state import StateEntry

PEFT_DIR = "lora"
WEIGHT = "weight"


def stage_file(stage: int) -> str:
    return f"lora_state_pp{stage:03d}.safetensors"


def _entries(adapters: list[LoraAdapter]) -> list[StateEntry]:
    """One optimizer-state entry per adapter parameter (no tensor plan: the adapters are laid out by `lora`)."""
    params = [p for adapter in adapters for p in adapter.parameters()]
    return [StateEntry(f"adapter parameter {i}", None, param, False) for i, param in enumerate(params)]


def _saved_state(local: dict[int, dict[str, torch.Tensor]], index: dict[int, int],
                 kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """`lora_state`'s `of`: an adapter parameter's `kind` optimizer tensor (`local` by entry, `index`: the entry of
    each parameter by id)."""
    return lambda param: local[index[id(param)]][kind]


@dataclass(frozen=True)
class LoraSave:
    """What `save_lora_checkpoint` did: the same `optimizer` and `files` on every rank; `held_bytes` this rank's."""

    optimizer: dict[str, Any]  # the adapters' optimizer summary (`optimizer_summary`)
    files: dict[str, str]  # each stage file's name -> its sha256
    # the adapter state this rank assembled whole for the stage file: optimizer state gathered from its
    # distributed-optimizer shards, and the tensors `lora_state` gathered (not the parts it only sent)
    held_bytes: int


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def save_lora_checkpoint(backend: MegatronBackend, staging: Path) -> LoraSave:
    """Collective over the role's group: write this stage's adapter file (first holder) and return the adapters'
    optimizer summary and the files written.

    Only what reaches the writer is gathered, and only to the ranks on its way: the writer's TP group sends its split
    halves to it, the writer's expert TP x EP group its experts; a distributed optimizer's shards go to the ranks that
    read them for that (each group's holder of them whole), and the other ranks only send their shards or sit out."""

    ctx = backend.ctx
    adapters = lora_adapters(backend.chunks)
    entries = _entries(adapters)
    view = OptimizerView(backend.optimizer)
    error, summary = None, None
    local: dict[int, dict[str, torch.Tensor]] = {}
    try:
        local, summary = local_optimizer_state(entries, view)
    except Exception as exc:  # noqa: BLE001 - agreed on below, before any further collective
        error = f"{type(exc).__name__}: {exc}"
    # each stage's writer: its first holder (TP, DP and CP rank 0), by this world-wide exchange rather than from the
    # ranks' order
    first_holder = ctx.tp_rank == 0 and ctx.dp_rank == 0 and ctx.cp_rank == 0
    agreed = agreed_summaries(ctx.world_size, error, (summary, ctx.pp_rank if first_holder else None))
    optimizer = optimizer_summary([rank_summary for rank_summary, _ in agreed])
    writer = next(rank for rank, (_, stage) in enumerate(agreed) if stage == ctx.pp_rank)
    kinds = optimizer["kinds"] if optimizer["step"] is not None else {}
    # the adapters whose halves travel to the writer (the dense ones over its TP group, the routed experts' over its
    # expert TP x EP group; on the writer, all), and of them the parameters whose optimizer state must be whole here
    to_writer = [adapter for adapter in adapters if reaches(adapter, writer)]
    read = {id(param) for param in parameters_read_for_root(to_writer, writer)}
    wanted = {i for i, entry in enumerate(entries) if id(entry.param) in read}
    gathered: dict[int, dict[str, torch.Tensor]] = {}
    if kinds and view.distributed:
        # each such parameter's shards whole on the one rank of the group megatron sharded it over (the dense adapters'
        # DP x CP, the routed experts' expert data-parallel group) that reads it
        try:
            gathered = gather_sharded(entries, local, view, kinds, wanted=wanted)
            local.update(gathered)
        except Exception as exc:  # noqa: BLE001 - a group's coverage error, agreed on over the world below
            error = f"{type(exc).__name__}: {exc}"
    partial = [entries[i].key for i in sorted(wanted) if any(
        kind not in local.get(i, {}) or local[i][kind].numel() != entries[i].param.numel() for kind in kinds)]
    # agreed before lora_state's collectives: a rank short of a whole state (or whose group's gather found a gap, which
    # the other groups' ranks did not see) raises on every rank, not in a hang
    short = f"the optimizer state of {partial[:2]} is not whole here" if partial else None
    agreed_summaries(ctx.world_size, error or short, None)
    index = {id(entry.param): i for i, entry in enumerate(entries)}
    tensors = {f"{WEIGHT}/{name}": t for name, t in lora_state(to_writer, root=writer).items()}
    for kind in kinds:
        state = lora_state(to_writer, of=_saved_state(local, index, kind), root=writer)
        tensors.update({f"{kind}/{name}": t for name, t in state.items()})
    held_bytes = _nbytes(t for by_kind in gathered.values() for t in by_kind.values()) + _nbytes(tensors.values())
    written = None
    if ctx.rank == writer:
        path = staging / stage_file(ctx.pp_rank)
        save_safetensors({k: v.contiguous() for k, v in tensors.items()}, path)
        written = (path.name, file_sha256(path))
    files: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(files, written)
    return LoraSave(optimizer, dict(f for f in files if f is not None), held_bytes)


def write_peft_folder(staging: Path, files: dict[str, str], settings: LoraSettings, base_model: str) -> None:
    """Rank 0, once every stage's file is written: the adapters as a PEFT adapter folder, `lora/`."""
    weights = {name.removeprefix(f"{WEIGHT}/"): tensor for name, tensor in _read(staging, files, WEIGHT).items()}
    save_peft_adapter(weights, settings, staging / PEFT_DIR, base_model=base_model)


def _read(ckpt_dir: Path, files: dict[str, str], kind: str | None = None) -> dict[str, torch.Tensor]:
    """Every stage file's tensors, checked against the recorded digests; `kind` (e.g. `weight`): those alone (the
    Adam moments, twice the adapters' bytes, are not read)."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for name, digest in sorted(files.items()):
        path = ckpt_dir / name
        if not path.is_file() or file_sha256(path) != digest:
            raise RoleCheckpointError(f"{path}: missing, or not the file the checkpoint recorded (sha256)")
        with safe_open(str(path), framework="pt") as stage:
            out.update({key: stage.get_tensor(key) for key in stage.keys()
                        if kind is None or key.startswith(f"{kind}/")})
    return out


def restore_lora_checkpoint(backend: MegatronBackend, ckpt_dir: Path, meta: dict[str, Any]) -> None:
    """Put the saved adapters and their optimizer state back, on this rank's layout (any)."""
    saved = _read(ckpt_dir, meta["lora"]["files"])
    by_kind: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in saved.items():
        kind, name = key.split("/", 1)
        by_kind.setdefault(kind, {})[name] = tensor
    adapters = lora_adapters(backend.chunks)
    load_lora_state(adapters, by_kind.pop(WEIGHT, {}))
    local = {kind: local_lora_tensors(adapters, state) for kind, state in by_kind.items()}
    load_optimizer(_entries(adapters), OptimizerView(backend.optimizer), meta["optimizer"],
                   lambda kind, entry: local[kind][entry.param])
