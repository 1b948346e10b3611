"""Save and restore one role's full training state atomically: resume gives the same next step, on the
layout it was saved with or on another one (TP, PP, VPP, DP, world size).

Folder layout (written by every rank of the role's group together: a collective):
  model/                the bridge's megatron checkpoint (policy roles): one safetensors file per
                        TP x PP rank, per-tensor sha256, readable by `load_weights` (any layout) and
                        `hybridrl convert`
  train_state/          the rest of the tensor state in model space, one safetensors file per TP x PP
                        rank (`state_tp00_pp000.safetensors`), written by DP rank 0 of that position,
                        with exactly the keys and shards of the model's files, prefixed by what they
                        hold:
                          param/<key>       the weights of value models (critic: the bridge format has
                                            no place for the scalar head)
                          main_param/<key>  the optimizer's fp32 master copy, when it differs from the
                                            model parameter (bf16/fp16 training)
                          exp_avg/<key>, exp_avg_sq/<key>   Adam's moments (momentum_buffer/<key>: SGD)
                        The distributed optimizer's DP shards are gathered to DP rank 0 for the save.
  rank_00003.pt         per rank: RNG streams (torch, python, numpy, megatron's tracker, CUDA), LR
                        schedule, the optimizer's param-group hyper-parameters and grad scaler
  role_checkpoint.json  role, format version, layout, world size, model shape, each rank's mesh
                        coordinates, the optimizer's step count and state kinds, and the sha256 of
                        every tensor in train_state/; written last
Everything is written into a hidden staging folder next to the target (`hybridrl.persistence`),
which rank 0 renames into place once every rank has succeeded; a crash leaves the previous
checkpoint untouched. Rank files
are plain tensors and containers, loaded with `torch.load(weights_only=True)` (no pickled code);
each has a `rank_NNNNN.pt.sha256` next to it, checked before loading (a tampered or truncated file
is named in the error instead of failing somewhere inside torch's unpickler). A rank checks the
tensors of every train_state file it will read against their recorded sha256 before it loads
anything.

Restoring on the saved layout reads each rank's own shards back unchanged (bit-identical next
step). On another layout, each tensor of the new shard is assembled from the saved shards by the
same tensor plans the weights use (`hybridrl.models.layout`, `checkpoint.read_pieces` +
`assemble`): one description of the layout for weights and optimizer state alike. Each rank reads
what it needs itself (a filesystem shared by the ranks, as for the weights); a distributed
optimizer takes its DP shard of each parameter. The model must be the same (shape compared field
by field, before anything is loaded). A value model's scalar head is replicated over TP and read
from the last stage's TP rank 0.

RNG streams are per rank and cannot be mapped across layouts. On the saved layout each rank gets
its own streams back. On another layout a rank takes the streams of the saved rank with the same
(tp, pp, dp) coordinates, else the same (tp, pp) at the lowest DP rank, else rank 0's (logged as a
warning: TP ranks then share megatron's model-parallel stream until it is reseeded); the LR
schedule, param-group hyper-parameters and grad scaler, identical on every rank, come from that
same file.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hybridrl.parallel.device import collective_device
from hybridrl.parallel.state import failed_ranks
from hybridrl.persistence import CheckpointError, atomic_file, commit_staging_dir, discard_staging_dir
from hybridrl.training.backend import MegatronBackend

logger = logging.getLogger(__name__)

METADATA = "role_checkpoint.json"
MODEL_DIR = "model"
STATE_DIR = "train_state"
FORMAT = "hybridrl-role-checkpoint"
VERSION = 2
PARAM = "param"
MAIN_PARAM = "main_param"
STEP = "step"
OUTPUT_LAYER = "output_layer.weight"
# torch param-group entries that select an implementation rather than set a hyper-parameter
_GROUP_SWITCHES = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})
# how megatron tells its param groups apart (weight decay / lr multipliers, expert params)
_GROUP_IDENTITY = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


class RoleCheckpointError(CheckpointError):
    """A role checkpoint is missing, incomplete, damaged, or was written for another model or role (a
    `CheckpointError`, like the trainer's and the converter's)."""


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def state_file(tp_rank: int, pp_rank: int) -> str:
    return f"state_tp{tp_rank:02d}_pp{pp_rank:03d}.safetensors"


def _all_ok(ok: bool, detail: str) -> None:
    failed = failed_ranks(ok, detail)
    if failed:
        raise RoleCheckpointError("role checkpoint failed on " + "; ".join(failed))


def _layout(ctx: Any) -> dict[str, Any]:
    return {"tp": ctx.tp, "pp": ctx.pp, "cp": ctx.cp, "dp": ctx.dp, "vpp": ctx.vpp}


# ---- the model's tensors, keyed as in the bridge's rank files -----------------------------------------

@dataclass(frozen=True)
class _Entry:
    key: str  # key inside a rank's file (VPP chunks prefixed), as in the bridge's megatron checkpoint
    plan: Any  # layout.TensorPlan: which HF ranges make this shard
    param: torch.Tensor  # the model parameter itself
    is_head: bool  # a value model's scalar head: replicated over TP, outside the layout math


def _entries(backend: MegatronBackend) -> list[_Entry]:
    from hybridrl.models.bridge import rank_tensor_entries

    return [_Entry(key, plan, param, backend.spec.value_head and plan.mcore_name == OUTPUT_LAYER)
            for key, plan, param in rank_tensor_entries(backend.chunks)]


def _shape(backend: MegatronBackend) -> Any:
    from hybridrl.models.bridge import chunk_info

    return chunk_info(backend.chunks[0]).source.shape


# ---- where each parameter's optimizer state lives -----------------------------------------------------

def _optimizer_parts(optimizer: Any) -> list[Any]:
    parts = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    return [p for p in parts
            if getattr(p, "optimizer", None) is not None and not getattr(p, "is_stub_optimizer", False)]


@dataclass(frozen=True)
class _Slot:
    inner: torch.optim.Optimizer
    main: torch.Tensor  # what the inner optimizer updates: the parameter, its fp32 master, or a DP shard of those
    start: int | None = None  # the flat range [start, stop) of the parameter `main` covers (distributed optimizer)
    stop: int | None = None

    def piece(self, full: torch.Tensor) -> torch.Tensor:
        """This slot's part of a parameter-shaped tensor, shaped like `main`."""
        if self.start is None:
            return full.reshape(self.main.shape)
        return full.reshape(-1)[self.start:self.stop]


class _OptimizerView:
    """Maps model parameters to (inner torch optimizer, main tensor, flat range) for megatron-core 0.16's
    FP32Optimizer, Float16OptimizerWithFloat16Params (fp32 master in `param.main_param`) and
    DistributedOptimizer (`model_param_group_index_map`: this DP rank's shard of each parameter)."""

    def __init__(self, optimizer: Any) -> None:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        self.parts = _optimizer_parts(optimizer)
        self.distributed: list[Any] = []
        self._sharded: dict[int, Any] = {}  # id(model param) -> the DistributedOptimizer sharding it
        self._slots: dict[int, _Slot] = {}
        self._plain: list[tuple[torch.optim.Optimizer, set[int]]] = []
        for part in self.parts:
            inner = part.optimizer
            if isinstance(part, DistributedOptimizer):
                self.distributed.append(part)
                for buffer in part.buffers:
                    for param in buffer.param_index_map:
                        self._sharded[id(param)] = part
                for param, (group, order) in part.model_param_group_index_map.items():
                    owned = part._get_model_param_range_map(param)["param"]
                    self._slots[id(param)] = _Slot(inner, inner.param_groups[group]["params"][order],
                                                   owned.start, owned.end)
            else:
                self._plain.append((inner, {id(p) for g in inner.param_groups for p in g["params"]}))

    def sharded_by(self, param: torch.Tensor) -> Any:
        return self._sharded.get(id(param))

    def slot(self, entry: _Entry) -> _Slot | None:
        """Where `entry`'s state lives on this rank; None when another DP rank holds all of it."""
        found = self._slots.get(id(entry.param))
        if found is not None:
            return found
        if id(entry.param) in self._sharded:
            return None
        master = None if getattr(entry.param, "main_param_sharded", False) else getattr(entry.param, "main_param", None)
        for inner, ids in self._plain:
            if master is not None and id(master) in ids:
                return _Slot(inner, master)
            if id(entry.param) in ids:
                return _Slot(inner, entry.param)
        raise RoleCheckpointError(f"parameter {entry.key} is not updated by the role's optimizer")


def _separate_master(slot: _Slot, entry: _Entry) -> bool:
    """The optimizer keeps its own (fp32) copy of this parameter: bf16/fp16 training."""
    return slot.main.dtype != entry.param.dtype


# ---- RNG ----------------------------------------------------------------------------------------------

def rng_state(device: str) -> dict[str, Any]:
    from megatron.core import tensor_parallel

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }
    if device == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def load_rng_state(state: dict[str, Any], device: str) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if device == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


# ---- saving -------------------------------------------------------------------------------------------

def _local_optimizer_state(entries: list[_Entry], view: _OptimizerView) -> tuple[dict[int, dict[str, torch.Tensor]],
                                                                                dict[str, Any]]:
    """This rank's optimizer tensors per entry index (whole, or its flat DP shard), and a summary."""
    local: dict[int, dict[str, torch.Tensor]] = {}
    steps: dict[float, str] = {}
    kinds: dict[str, str] = {}
    with_state, without_state = [], []
    for index, entry in enumerate(entries):
        slot = view.slot(entry)
        if slot is None:
            continue
        tensors: dict[str, torch.Tensor] = {}
        if _separate_master(slot, entry):
            tensors[MAIN_PARAM] = slot.main.detach()
        state = slot.inner.state.get(slot.main)
        if state:
            with_state.append(entry.key)
            for name, value in state.items():
                if name == STEP and torch.is_tensor(value) and value.numel() == 1:
                    steps[float(value)] = str(value.dtype).removeprefix("torch.")
                elif torch.is_tensor(value) and value.numel() == slot.main.numel():
                    tensors[name] = value.detach()
                else:
                    raise RoleCheckpointError(
                        f"optimizer state {name!r} of {entry.key} ({type(value).__name__}) has no model-space "
                        f"form: only per-element tensors and the scalar {STEP!r} can be saved")
        else:
            without_state.append(entry.key)
        for name, value in tensors.items():
            kinds[name] = str(value.dtype).removeprefix("torch.")
        local[index] = tensors
    summary = {"steps": steps, "kinds": kinds, "with_state": with_state[:1], "without_state": without_state[:1],
               "stateful": bool(with_state)}
    return local, summary


def _optimizer_summary(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One description of the optimizer state from every rank's summary (identical on all ranks)."""
    steps: dict[float, str] = {}
    kinds: dict[str, str] = {}
    for s in summaries:
        steps.update(s["steps"])
        kinds.update(s["kinds"])
    stateful = [s for s in summaries if s["stateful"]]
    if stateful:
        missing = [k for s in summaries for k in s["without_state"]]
        if missing:
            raise RoleCheckpointError(f"the optimizer has state for {stateful[0]['with_state'][0]} but none for "
                                      f"{missing[0]}: a partly initialized optimizer cannot be saved")
        if len(steps) != 1:
            raise RoleCheckpointError(f"optimizer step counts differ across parameters: {sorted(steps)}")
    step, step_dtype = next(iter(steps.items())) if stateful else (None, None)
    return {"kinds": dict(sorted(kinds.items())), "step": step, "step_dtype": step_dtype}


def _gather_sharded(entries: list[_Entry], local: dict[int, dict[str, torch.Tensor]], view: _OptimizerView,
                    kinds: dict[str, str]) -> dict[int, dict[str, torch.Tensor]]:
    """Collective over each distributed optimizer's DP group: the full state of the parameters it shards,
    on DP rank 0 (empty elsewhere). Each DP rank owns a contiguous flat range of a parameter. A
    coverage error is raised only after every collective ran (peers never wait on a failed rank)."""
    full: dict[int, dict[str, torch.Tensor]] = {}
    problems: list[str] = []
    for part in view.distributed:
        group = getattr(part, "data_parallel_group_gloo", None) or part.data_parallel_group
        device = collective_device(group)
        size, is_dst, dst = dist.get_world_size(group), dist.get_rank(group) == 0, dist.get_global_rank(group, 0)
        members = [i for i, e in enumerate(entries) if view.sharded_by(e.param) is part]
        slots = {i: view.slot(entries[i]) for i in members}
        for kind, dtype_name in kinds.items():
            dtype = getattr(torch, dtype_name)
            owned = [(i, s.start, s.stop) for i, s in slots.items() if s is not None and kind in local[i]]
            indices: list[Any] = [None] * size
            dist.all_gather_object(indices, owned, group=group)
            width = max(sum(stop - start for _, start, stop in idx) for idx in indices)
            send = torch.zeros(width, dtype=dtype, device=device)
            offset = 0
            for i, start, stop in owned:
                send[offset:offset + stop - start] = local[i][kind].reshape(-1).to(device)
                offset += stop - start
            received = [torch.empty(width, dtype=dtype, device=device) for _ in range(size)] if is_dst else None
            dist.gather(send, received, dst=dst, group=group)
            if not is_dst:
                continue
            covered: dict[int, int] = {}
            for idx, chunk in zip(indices, received):
                offset = 0
                for i, start, stop in idx:
                    target = full.setdefault(i, {}).setdefault(kind, torch.empty(entries[i].param.numel(), dtype=dtype))
                    target[start:stop] = chunk[offset:offset + stop - start].cpu()
                    offset += stop - start
                    covered[i] = covered.get(i, 0) + stop - start
            problems += [f"{kind} of {entries[i].key}: DP shards cover {n} of {entries[i].param.numel()} elements"
                         for i, n in covered.items() if n != entries[i].param.numel()]
    if problems:
        raise RoleCheckpointError("distributed optimizer state does not gather whole: " + "; ".join(problems[:4]))
    return {i: {k: t.reshape(entries[i].param.shape) for k, t in by_kind.items()} for i, by_kind in full.items()}


def _state_tensors(backend: MegatronBackend) -> tuple[dict[str, torch.Tensor], dict[str, Any], _OptimizerView | None]:
    """Collective: the train_state tensors this rank writes (DP rank 0 of each TP x PP position), the
    optimizer description (same on every rank) and the optimizer view. Local failures are agreed on
    before any further collective, so every rank raises together."""
    ctx = backend.ctx
    error, summary = None, None
    try:
        entries = _entries(backend)
        view = _OptimizerView(backend.optimizer) if backend.optimizer is not None else None
        local, summary = _local_optimizer_state(entries, view) if view is not None else ({}, None)
    except Exception as exc:  # noqa: BLE001 - shared with every rank below
        error = f"{type(exc).__name__}: {exc}"
    summaries: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(summaries, (error, summary))
    failed = [f"rank {r}: {e}" for r, (e, _) in enumerate(summaries) if e]
    if failed:
        raise RoleCheckpointError("; ".join(failed))
    out: dict[str, torch.Tensor] = {}
    writer = ctx.dp_rank == 0 and ctx.cp_rank == 0
    if backend.spec.value_head and writer:
        for entry in entries:
            out[f"{PARAM}/{entry.key}"] = entry.param.detach().cpu()
    if view is None:
        return out, {"kinds": {}, "step": None, "step_dtype": None}, None
    optimizer = _optimizer_summary([s for _, s in summaries])
    if optimizer["step"] is None:  # never stepped: the master copies equal the weights, nothing else to keep
        return out, optimizer, view
    gathered = _gather_sharded(entries, local, view, optimizer["kinds"])
    if writer:
        for index, entry in enumerate(entries):
            if view.sharded_by(entry.param) is not None:
                tensors = gathered.get(index)
                if tensors is None:
                    raise RoleCheckpointError(f"DP rank 0 of the distributed optimizer is not this position's "
                                              f"writer (no gathered state for {entry.key})")
            else:
                tensors = local[index]
            for kind, value in tensors.items():
                out[f"{kind}/{entry.key}"] = value.detach().reshape(entry.param.shape).cpu()
    return out, optimizer, view


def _rank_optimizer_meta(view: _OptimizerView | None) -> dict[str, Any] | None:
    if view is None:
        return None
    parts = []
    for part in view.parts:
        scaler = getattr(part, "grad_scaler", None)
        parts.append({
            "param_groups": [{k: v for k, v in g.items() if k not in _GROUP_SWITCHES}
                             for g in part.optimizer.param_groups],
            "grad_scaler": scaler.state_dict() if scaler is not None else None,
        })
    return {"parts": parts}


def save_role_checkpoint(backend: MegatronBackend, out_dir: str | Path) -> Path:
    """Collective over the role's group: write the role's state into `out_dir` (replaced if present)."""
    from hybridrl.models.bridge import save_mcore_checkpoint, shared_staging_dir
    from hybridrl.models.checkpoint import write_rank_file

    ctx = backend.ctx
    out_dir = Path(out_dir).absolute()
    try:
        staging = shared_staging_dir(out_dir, True, ctx)
    except CheckpointError as exc:  # the same error on every rank
        raise RoleCheckpointError(str(exc)) from exc
    ok, detail = True, ""
    optimizer: dict[str, Any] = {}
    entry: tuple[str, dict[str, Any]] | None = None
    try:
        if not backend.spec.value_head:
            save_mcore_checkpoint(backend.chunks, staging / MODEL_DIR, ctx=ctx)
        tensors, optimizer, view = _state_tensors(backend)
        if tensors:
            folder = staging / STATE_DIR
            folder.mkdir(exist_ok=True)
            name = state_file(ctx.tp_rank, ctx.pp_rank)
            entry = (name, {"tp_rank": ctx.tp_rank, "pp_rank": ctx.pp_rank,
                            "tensors": write_rank_file(folder / name, tensors)})
        state: dict[str, Any] = {
            "role": str(backend.spec.role), "rank": ctx.rank,
            "rng": rng_state(ctx.device),
            "optimizer": _rank_optimizer_meta(view),
            "schedule": backend.schedule.state_dict() if backend.schedule is not None else None,
        }
        target = staging / rank_file(ctx.rank)
        with atomic_file(target) as partial_file:
            torch.save(state, partial_file)
        (staging / (target.name + ".sha256")).write_text(_file_sha256(target) + "\n")
    except Exception as exc:  # noqa: BLE001
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    try:
        _all_ok(ok, detail)
        files: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(files, entry)
        coords: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(coords, {"tp": ctx.tp_rank, "pp": ctx.pp_rank, "dp": ctx.dp_rank, "cp": ctx.cp_rank})
        if ctx.rank == 0:
            meta = {"format": FORMAT, "version": VERSION, "role": str(backend.spec.role), "world_size": ctx.world_size,
                    "layout": _layout(ctx), "value_head": backend.spec.value_head,
                    "shape": _shape(backend).to_dict(), "ranks": coords, "optimizer": optimizer,
                    "optimizer_steps": backend.schedule.step_count if backend.schedule is not None else 0,
                    "train_state": dict(e for e in files if e is not None)}
            (staging / METADATA).write_text(json.dumps(meta, indent=1))
            commit_staging_dir(staging, out_dir)
        dist.barrier()
    except BaseException:
        if ctx.rank == 0:
            discard_staging_dir(staging)
        raise
    return out_dir


# ---- reading ------------------------------------------------------------------------------------------

def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _load_rank_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise RoleCheckpointError(f"{path} is missing (each rank of the saved layout writes one)")
    sidecar = path.with_name(path.name + ".sha256")
    if sidecar.is_file():  # older checkpoints have none
        expected, actual = sidecar.read_text().strip(), _file_sha256(path)
        if actual != expected:
            raise RoleCheckpointError(f"{path}: sha256 {actual[:16]}... does not match the saved {expected[:16]}... "
                                      "(the file was modified or truncated after the save)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - re-raised naming the file
        raise RoleCheckpointError(f"{path} is not a readable rank state file: {type(exc).__name__}: {exc}") from exc


class _TrainState:
    """The train_state/ files: a rank's own shards as saved, or any tensor of another layout's shard
    assembled from them through the layout math. Each file is verified (per-tensor sha256) on first use."""

    def __init__(self, folder: Path, meta: dict[str, Any]) -> None:
        from hybridrl.models.arch import ModelShape
        from hybridrl.models.checkpoint import _SafetensorsFiles
        from hybridrl.models.layout import ParallelLayout, hf_export_map

        self.folder = folder
        self.files: dict[str, Any] = meta.get("train_state", {})
        saved = meta["layout"]
        self.layout = ParallelLayout(tp=saved["tp"], pp=saved["pp"], vpp=saved["vpp"])
        self.shape = ModelShape(**meta["shape"])
        self._open = _SafetensorsFiles()
        self._keys: dict[str, set[str]] = {}
        self._pieces = hf_export_map(self.shape, self.layout)

    def handle(self, tp_rank: int, pp_rank: int) -> Any:
        from hybridrl.models.checkpoint import tensor_sha256

        name = state_file(tp_rank, pp_rank)
        path = self.folder / name
        recorded = self.files.get(name)
        if recorded is None:
            raise RoleCheckpointError(f"{path} is not listed in the checkpoint's {METADATA}")
        if not path.is_file():
            raise RoleCheckpointError(f"{path} is missing (DP rank 0 of each TP x PP position writes one)")
        try:
            handle = self._open.get(path)
        except CheckpointError as exc:
            raise RoleCheckpointError(str(exc)) from exc
        if name not in self._keys:
            keys = set(handle.keys())
            if keys != set(recorded["tensors"]):
                diff = sorted(keys ^ set(recorded["tensors"]))
                raise RoleCheckpointError(f"{path} does not hold the tensors recorded for it: {', '.join(diff[:6])}")
            for key, info in recorded["tensors"].items():
                if tensor_sha256(handle.get_tensor(key)) != info["sha256"]:
                    raise RoleCheckpointError(f"checksum mismatch in {path}, tensor {key}: the file was modified "
                                              "or corrupted after it was written")
            self._keys[name] = keys
        return handle

    def positions_for(self, entries: list[_Entry]) -> set[tuple[int, int]]:
        """The saved (tp, pp) positions whose files hold a part of these (new-layout) shards."""
        needed = set()
        for entry in entries:
            if entry.is_head:
                needed.add((0, self.layout.pp - 1))
                continue
            for seg in entry.plan.segments:
                if seg.hf_name is None:
                    continue
                for piece in self._pieces[seg.hf_name]:
                    if piece.axis is None or (piece.hf_start < seg.stop and seg.start < piece.hf_stop):
                        needed.add((piece.tp_rank, piece.pp_rank))
                        if piece.axis is None:
                            break  # a replicated tensor is read from its first holder
        return needed

    def verify(self, positions: set[tuple[int, int]]) -> None:
        """Check the files of these (tp, pp) positions before anything is loaded (listed files only:
        a checkpoint without optimizer state has none)."""
        for recorded in self.files.values():
            if (recorded["tp_rank"], recorded["pp_rank"]) in positions:
                self.handle(recorded["tp_rank"], recorded["pp_rank"])

    def own(self, kind: str, key: str, tp_rank: int, pp_rank: int) -> torch.Tensor:
        handle = self.handle(tp_rank, pp_rank)
        name = f"{kind}/{key}"
        if name not in self._keys[state_file(tp_rank, pp_rank)]:
            raise RoleCheckpointError(f"{self.folder / state_file(tp_rank, pp_rank)} lacks tensor {name}")
        return handle.get_tensor(name)

    def head(self, kind: str) -> torch.Tensor:
        """A value model's head (replicated over TP): as saved by the last stage's TP rank 0."""
        from hybridrl.models.layout import rank_chunk_key_prefix

        last = self.layout.num_chunks_per_stage - 1
        key = rank_chunk_key_prefix(self.layout, last if self.layout.vpp else None) + OUTPUT_LAYER
        return self.own(kind, key, 0, self.layout.pp - 1)

    def assemble(self, kind: str, plan: Any) -> torch.Tensor:
        from hybridrl.models.checkpoint import assemble

        return assemble(_KindReader(self, kind), plan)

    def close(self) -> None:
        self._open.close()


class _KindReader:
    """`read(hf_name, axis, start, stop)` over one kind of train_state tensor (what `assemble` needs)."""

    def __init__(self, store: _TrainState, kind: str) -> None:
        self.store, self.prefix = store, f"{kind}/"

    def read(self, hf_name: str, axis: int | None, start: int, stop: int) -> torch.Tensor:
        from hybridrl.models.checkpoint import read_pieces

        return read_pieces(self.store._pieces[hf_name], self.store.handle, axis, start, stop, self.prefix)


def _read_meta(ckpt_dir: Path) -> dict[str, Any]:
    meta_path = ckpt_dir / METADATA
    if not meta_path.is_file():
        raise RoleCheckpointError(f"{ckpt_dir} is not a complete role checkpoint (no {METADATA})")
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as exc:
        raise RoleCheckpointError(f"{meta_path} is not valid JSON ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise RoleCheckpointError(f"{meta_path}: format {meta.get('format') if isinstance(meta, dict) else None!r}, "
                                  f"expected {FORMAT!r}")
    if meta.get("version", 1) != VERSION:
        raise RoleCheckpointError(
            f"{meta_path}: format version {meta.get('version', 1)}, this hybridrl reads version {VERSION} "
            "(version 1 kept the optimizer state per rank; resume it with the hybridrl that wrote it)")
    return meta


def _check_model(backend: MegatronBackend, meta: dict[str, Any], ckpt_dir: Path) -> None:
    if meta["role"] != backend.spec.role:
        raise RoleCheckpointError(f"{ckpt_dir} holds role {meta['role']!r}, this is {str(backend.spec.role)!r}")
    if bool(meta.get("value_head")) != backend.spec.value_head:
        raise RoleCheckpointError(f"{ckpt_dir}: value_head={meta.get('value_head')} in the checkpoint, "
                                  f"{backend.spec.value_head} for this role")
    own = json.loads(json.dumps(_shape(backend).to_dict()))
    saved = meta["shape"]
    differ = [f"{k}={saved.get(k)!r} (this model: {own.get(k)!r})" for k in sorted(set(own) | set(saved))
              if own.get(k) != saved.get(k)]
    if differ:
        raise RoleCheckpointError(f"{ckpt_dir} was saved from another model: " + ", ".join(differ))


def _source_rank(meta: dict[str, Any], ctx: Any) -> int:
    """The saved rank whose RNG streams (and schedule) this rank takes on another layout."""
    ranks = meta["ranks"]
    for want in ((ctx.tp_rank, ctx.pp_rank, ctx.dp_rank), (ctx.tp_rank, ctx.pp_rank)):
        for rank, c in enumerate(ranks):
            if (c["tp"], c["pp"], c["dp"])[:len(want)] == want:
                return rank
    logger.warning("rank %d (tp %d, pp %d, dp %d): no saved rank at these coordinates in layout %s; taking the "
                   "RNG streams of saved rank 0", ctx.rank, ctx.tp_rank, ctx.pp_rank, ctx.dp_rank, meta["layout"])
    return 0


def _saved_tensor(store: _TrainState, kind: str, entry: _Entry, same: bool, ctx: Any) -> torch.Tensor:
    """This rank's `kind` tensor for `entry`: its own saved shard, the whole head, or re-sharded."""
    if same:
        value = store.own(kind, entry.key, ctx.tp_rank, ctx.pp_rank)
    elif entry.is_head:
        value = store.head(kind)
    else:
        value = store.assemble(kind, entry.plan)
    if tuple(value.shape) != tuple(entry.param.shape):
        raise RoleCheckpointError(f"{kind} of {entry.key}: saved shape {list(value.shape)}, this model "
                                  f"{list(entry.param.shape)}")
    return value


@torch.no_grad()
def _load_value_weights(entries: list[_Entry], store: _TrainState, same: bool, ctx: Any) -> None:
    for entry in entries:
        entry.param.copy_(_saved_tensor(store, PARAM, entry, same, ctx))


@torch.no_grad()
def _load_optimizer(entries: list[_Entry], view: _OptimizerView, store: _TrainState, meta: dict[str, Any],
                    same: bool, ctx: Any) -> None:
    described = meta["optimizer"]
    kinds, step = described["kinds"], described["step"]
    for part in view.parts:
        part.optimizer.state.clear()
    for entry in entries:
        slot = view.slot(entry)
        if slot is None:
            continue

        def full(kind: str, entry: _Entry = entry) -> torch.Tensor:
            return _saved_tensor(store, kind, entry, same, ctx)

        if _separate_master(slot, entry):
            master = full(MAIN_PARAM) if step is not None and MAIN_PARAM in kinds else entry.param.detach()
            slot.main.copy_(slot.piece(master))
        if step is None:
            continue
        state: dict[str, torch.Tensor] = {STEP: torch.tensor(step, dtype=getattr(torch, described["step_dtype"]))}
        for kind in kinds:
            if kind != MAIN_PARAM:
                state[kind] = slot.piece(full(kind)).to(slot.main.device, copy=True)
        slot.inner.state[slot.main] = state


def _load_group_settings(view: _OptimizerView, saved: dict[str, Any] | None) -> None:
    """Param-group hyper-parameters (by megatron's group identity) and the grad scaler, per optimizer part."""
    if saved is None:
        return
    for part, saved_part in zip(view.parts, saved["parts"]):
        by_identity = {tuple(g.get(k) for k in _GROUP_IDENTITY): g for g in saved_part["param_groups"]}
        for group in part.optimizer.param_groups:
            match = by_identity.get(tuple(group.get(k) for k in _GROUP_IDENTITY))
            if match is not None:
                group.update({k: v for k, v in match.items() if k not in _GROUP_SWITCHES})
        scaler = getattr(part, "grad_scaler", None)
        if scaler is not None and saved_part["grad_scaler"] is not None:
            scaler.load_state_dict(saved_part["grad_scaler"])


def load_role_checkpoint(backend: MegatronBackend, ckpt_dir: str | Path) -> dict[str, Any]:
    """Restore weights, optimizer state, LR schedule and RNG saved by `save_role_checkpoint`, on the saved
    layout or another one (see the module docstring). Returns the checkpoint's metadata plus `resharded`
    and `rng_source_rank`."""
    from hybridrl.models.bridge import load_weights

    ctx = backend.ctx
    ckpt_dir = Path(ckpt_dir)
    meta = _read_meta(ckpt_dir)
    _check_model(backend, meta, ckpt_dir)
    same = meta["layout"] == _layout(ctx) and meta["world_size"] == ctx.world_size
    source = ctx.rank if same else _source_rank(meta, ctx)
    state = _load_rank_file(ckpt_dir / rank_file(source))
    if backend.optimizer is not None and state.get("optimizer") is None:
        raise RoleCheckpointError(f"{ckpt_dir} holds no optimizer state (saved from a frozen role?)")
    entries = _entries(backend)
    store = _TrainState(ckpt_dir / STATE_DIR, meta)
    try:
        # a damaged file fails before anything is loaded; each rank reads (and checks) only what it needs
        store.verify({(ctx.tp_rank, ctx.pp_rank)} if same else store.positions_for(entries))
        if backend.spec.value_head:
            _load_value_weights(entries, store, same, ctx)
        else:
            load_weights(backend.chunks, ckpt_dir / MODEL_DIR)
        if backend.optimizer is not None:
            view = _OptimizerView(backend.optimizer)
            _load_optimizer(entries, view, store, meta, same, ctx)
            _load_group_settings(view, state["optimizer"])
            backend.schedule.load_state_dict(state["schedule"])
    finally:
        store.close()
    load_rng_state(state["rng"], ctx.device)
    return {**meta, "resharded": not same, "rng_source_rank": source}
