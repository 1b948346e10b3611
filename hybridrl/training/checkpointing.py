"""Save and restore one role's full training state atomically: resume gives the same next step, on the
layout it was saved with or on another one (TP, PP, VPP, DP, world size).

This module owns the folder's format and the save / load collectives; the ideas they use are
modules of their own: `train_state.py` (the train_state/ folder: the model's tensors keyed as in
the bridge's files, read back as saved or re-sharded), `optimizer_state.py` (where each parameter's
optimizer state lives, gathered whole and put back as a rank's part), `rng.py` (RNG streams), and
`hybridrl.persistence` (the staging folder, `RoleCheckpointError`).

Folder layout (written by every rank of the role's group together: a collective):
  model/                the bridge's megatron checkpoint (policy roles): one safetensors file per
                        rank file position (TP x PP; per stage slot for expert-parallel models),
                        per-tensor sha256, readable by `load_weights` (any layout) and `hybridrl convert`
  train_state/          the rest of the tensor state in model space, one safetensors file per rank
                        file position (`state_tp00_pp000.safetensors`; `..._ep001[_etp00]` for an
                        expert-parallel model), written by its first rank (DP rank 0 of a TP x PP
                        position), with the keys and shards of the model's files that position is the
                        first holder of (`train_state.py`), prefixed by what they hold:
                          param/<key>       the weights of value models (critic: the bridge format has
                                            no place for the scalar head)
                          main_param/<key>  the optimizer's fp32 master copy, when it differs from the
                                            model parameter (bf16/fp16 training)
                          exp_avg/<key>, exp_avg_sq/<key>   Adam's moments (momentum_buffer/<key>: SGD)
                        The distributed optimizer's DP shards are gathered to DP rank 0 for the save
                        (an expert's to expert-DP rank 0).
  rank_00003.pt         per rank: RNG streams (torch, python, numpy, megatron's tracker, CUDA), LR
                        schedule, the optimizer's param groups and grad scaler (a resume takes back the
                        scaler and what a group gained while stepping; the hyper-parameters are the job's)
  role_checkpoint.json  role, format version, layout, world size, model shape, each rank's mesh
                        coordinates, the optimizer's step count and state kinds, and the sha256 of
                        every tensor in train_state/; written last
Everything is written into a hidden staging folder next to the target (`hybridrl.persistence`),
which rank 0 renames into place once every rank has succeeded; a crash leaves the previous
checkpoint untouched. Rank files are plain tensors and containers, loaded with
`torch.load(weights_only=True)` (no pickled code); each has a `rank_NNNNN.pt.sha256` next to it,
checked before loading (a tampered or truncated file is named in the error instead of failing
somewhere inside torch's unpickler). A rank checks the tensors of every train_state file it will
read against their recorded sha256 before it loads anything.

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
schedule's position, the param groups' stepping state and the grad scaler, identical on every rank, come from
that same file.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.models.bridge import chunk_info, load_weights, save_mcore_checkpoint, shared_staging_dir
from hybridrl.models.checkpoint import MODEL_DIR, write_rank_file
from hybridrl.models.layout import holder_slot, rank_file_fields
from hybridrl.parallel.state import failed_ranks
from hybridrl.persistence import (
    CheckpointError,
    RoleCheckpointError,
    atomic_file,
    commit_staging_dir,
    discard_staging_dir,
    file_sha256,
)
from hybridrl.training.backend import MegatronBackend
from hybridrl.training.lora_checkpoint import (
    LoraSave,
    restore_lora_checkpoint,
    save_lora_checkpoint,
    write_peft_folder,
)
from hybridrl.training.optimizer_state import (
    OptimizerView,
    agreed_summaries,
    gather_sharded,
    load_group_settings,
    load_optimizer,
    local_optimizer_state,
    optimizer_summary,
    rank_optimizer_meta,
)
from hybridrl.training.rng import load_rng_state, rng_state
from hybridrl.training.train_state import (
    METADATA,
    PARAM,
    STATE_DIR,
    StateEntry,
    TrainState,
    holder_rank,
    saved_tensor,
    state_entries,
    state_file,
)

logger = logging.getLogger(__name__)

FORMAT = "hybridrl-role-checkpoint"
VERSION = 2


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _settings(backend: MegatronBackend) -> dict[str, Any]:
    """A LoRA actor's adapter settings as the metadata keeps them (JSON), which a resume must match; not the seed
    (it draws the first A only: a resumed run may change trainer.seed)."""
    settings = asdict(backend.spec.adapter_settings)
    settings.pop("seed")
    return json.loads(json.dumps(settings))


def _all_ok(ok: bool, detail: str) -> None:
    failed = failed_ranks(ok, detail)
    if failed:
        raise RoleCheckpointError("role checkpoint failed on " + "; ".join(failed))


def _layout(ctx: Any) -> dict[str, Any]:
    # an uneven stage split, EP and an expert TP other than TP only when used: other checkpoints'
    # metadata stays as it was
    optional = {"first_stage_layers": ctx.first_stage_layers, "last_stage_layers": ctx.last_stage_layers,
                "ep": ctx.ep if ctx.ep > 1 else None, "etp": ctx.etp if ctx.etp not in (None, ctx.tp) else None}
    return {"tp": ctx.tp, "pp": ctx.pp, "cp": ctx.cp, "dp": ctx.dp, "vpp": ctx.vpp} | {
        k: v for k, v in optional.items() if v is not None}


def _shape(backend: MegatronBackend) -> Any:
    return chunk_info(backend.chunks[0]).source.shape


# ---- saving -------------------------------------------------------------------------------------------

def _state_tensors(backend: MegatronBackend) -> tuple[dict[str, torch.Tensor], dict[str, Any], OptimizerView | None]:
    """Collective: the train_state tensors this rank writes (the first holder of each tensor: DP rank 0
    of each TP x PP position, for experts expert-DP rank 0), the optimizer description (same on every
    rank) and the optimizer view. Local failures are agreed on before any further collective, so every
    rank raises together."""
    ctx = backend.ctx
    error, summary = None, None
    try:
        entries = state_entries(backend)
        view = OptimizerView(backend.optimizer) if backend.optimizer is not None else None
        local_state, summary = local_optimizer_state(entries, view) if view is not None else ({}, None)
    except Exception as exc:  # noqa: BLE001 - shared with every rank below
        error = f"{type(exc).__name__}: {exc}"
    summaries = agreed_summaries(ctx.world_size, error, summary)
    out: dict[str, torch.Tensor] = {}
    # This rank writes the entries whose first holder its slot is (dense: DP/CP rank 0; experts:
    # expert-DP rank 0), which are also the ranks a distributed optimizer gathers their state to.
    layout = chunk_info(backend.chunks[0]).layout
    local = ctx.rank % (ctx.world_size // ctx.pp)
    writes = [local < layout.slots and holder_slot(layout, local, e.plan.expert) == local for e in entries]
    if backend.spec.value_head:
        for entry, write in zip(entries, writes):
            if write:
                out[f"{PARAM}/{entry.key}"] = entry.param.detach().cpu()
    if view is None:
        return out, {"kinds": {}, "step": None, "step_dtype": None}, None
    optimizer = optimizer_summary(summaries)
    if optimizer["step"] is None:  # never stepped: the master copies equal the weights, nothing else to keep
        return out, optimizer, view
    gathered = gather_sharded(entries, local_state, view, optimizer["kinds"])
    for index, (entry, write) in enumerate(zip(entries, writes)):
        if write:
            if view.sharded_by(entry.param) is not None:
                tensors = gathered.get(index)
                if tensors is None:
                    raise RoleCheckpointError(f"DP rank 0 of the distributed optimizer is not this position's "
                                              f"writer (no gathered state for {entry.key})")
            else:
                tensors = local_state[index]
            for kind, value in tensors.items():
                out[f"{kind}/{entry.key}"] = value.detach().reshape(entry.param.shape).cpu()
    return out, optimizer, view


def save_role_checkpoint(backend: MegatronBackend, out_dir: str | Path) -> Path:
    """Collective over the role's group: write the role's state into `out_dir` (replaced if present)."""

    ctx = backend.ctx
    out_dir = Path(out_dir).absolute()
    try:
        staging = shared_staging_dir(out_dir, True, ctx)
    except CheckpointError as exc:  # the same error on every rank
        raise RoleCheckpointError(str(exc)) from exc
    ok, detail = True, ""
    optimizer: dict[str, Any] = {}
    entry: tuple[str, dict[str, Any]] | None = None
    lora: LoraSave | None = None
    try:
        if not backend.spec.value_head:
            save_mcore_checkpoint(backend.chunks, staging / MODEL_DIR, ctx=ctx)
        tensors: dict[str, torch.Tensor]
        view: OptimizerView | None
        if backend.spec.lora is not None:  # the frozen base above; the adapters and their optimizer state
            lora = save_lora_checkpoint(backend, staging)
            tensors, optimizer, view = {}, lora.optimizer, OptimizerView(backend.optimizer)
        else:
            tensors, optimizer, view = _state_tensors(backend)
        if tensors:
            folder = staging / STATE_DIR
            folder.mkdir(exist_ok=True)
            info = chunk_info(backend.chunks[0])
            name = state_file(info.layout, info.rank)
            entry = (name, rank_file_fields(info.layout, info.rank)
                     | {"tensors": write_rank_file(folder / name, tensors)})
        state: dict[str, Any] = {
            "role": str(backend.spec.role), "rank": ctx.rank,
            "rng": rng_state(backend.spec.device_policy),
            "optimizer": rank_optimizer_meta(view),
            "schedule": backend.schedule.state_dict() if backend.schedule is not None else None,
        }
        target = staging / rank_file(ctx.rank)
        with atomic_file(target) as partial_file:
            torch.save(state, partial_file)
        (staging / (target.name + ".sha256")).write_text(file_sha256(target) + "\n")
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
            if lora is not None:
                meta["lora"] = {"files": lora.files, "settings": _settings(backend)}
                write_peft_folder(staging, lora.files, backend.spec.adapter_settings, backend.spec.model_path)
            (staging / METADATA).write_text(json.dumps(meta, indent=1))
            commit_staging_dir(staging, out_dir)
        dist.barrier()
    except BaseException:
        if ctx.rank == 0:
            discard_staging_dir(staging)
        raise
    return out_dir


# ---- reading ------------------------------------------------------------------------------------------

def _load_rank_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise RoleCheckpointError(f"{path} is missing (each rank of the saved layout writes one)")
    sidecar = path.with_name(path.name + ".sha256")
    if sidecar.is_file():  # older checkpoints have none
        expected, actual = sidecar.read_text().strip(), file_sha256(path)
        if actual != expected:
            raise RoleCheckpointError(f"{path}: sha256 {actual[:16]}... does not match the saved {expected[:16]}... "
                                      "(the file was modified or truncated after the save)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - re-raised naming the file
        raise RoleCheckpointError(f"{path} is not a readable rank state file: {type(exc).__name__}: {exc}") from exc


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


@torch.no_grad()
def _load_value_weights(entries: list[StateEntry], store: TrainState, same: bool, ctx: Any) -> None:
    for entry in entries:
        entry.param.copy_(saved_tensor(store, PARAM, entry, same, ctx))


def load_role_checkpoint(backend: MegatronBackend, ckpt_dir: str | Path) -> dict[str, Any]:
    """Restore weights, optimizer state, LR schedule and RNG saved by `save_role_checkpoint`, on the saved
    layout or another one (see the module docstring). Returns the checkpoint's metadata plus `resharded`
    and `rng_source_rank`."""

    ctx = backend.ctx
    ckpt_dir = Path(ckpt_dir)
    meta = _read_meta(ckpt_dir)
    _check_model(backend, meta, ckpt_dir)
    same = meta["layout"] == _layout(ctx) and meta["world_size"] == ctx.world_size
    source = ctx.rank if same else _source_rank(meta, ctx)
    state = _load_rank_file(ckpt_dir / rank_file(source))
    if backend.optimizer is not None and state.get("optimizer") is None:
        raise RoleCheckpointError(f"{ckpt_dir} holds no optimizer state (saved from a frozen role?)")
    if ("lora" in meta) != (backend.spec.lora is not None):
        raise RoleCheckpointError(f"{ckpt_dir} was saved {'with' if 'lora' in meta else 'without'} LoRA adapters; "
                                  f"this actor has {'none' if backend.spec.lora is None else 'adapters'}: resume with "
                                  "the actor_rollout_ref.model.lora settings it was saved with")
    if backend.spec.lora is not None:
        if meta["lora"]["settings"] != _settings(backend):
            raise RoleCheckpointError(f"{ckpt_dir}: saved with LoRA settings {meta['lora']['settings']}, this actor's "
                                      f"are {_settings(backend)}")
        load_weights(backend.chunks, ckpt_dir / MODEL_DIR)  # the frozen base
        restore_lora_checkpoint(backend, ckpt_dir, meta)
        load_group_settings(OptimizerView(backend.optimizer), state["optimizer"])
        backend.trained_schedule.load_state_dict(state["schedule"])
        load_rng_state(state["rng"], backend.spec.device_policy)
        return {**meta, "resharded": not same, "rng_source_rank": source}
    entries = state_entries(backend)
    store = TrainState(ckpt_dir / STATE_DIR, meta)
    try:
        # a damaged file fails before anything is loaded; each rank reads (and checks) only what it needs
        store.verify({holder_rank(store.layout, entry, ctx) for entry in entries} if same
                     else store.positions_for(entries))
        if backend.spec.value_head:
            _load_value_weights(entries, store, same, ctx)
        else:
            load_weights(backend.chunks, ckpt_dir / MODEL_DIR)
        if backend.optimizer is not None:
            view = OptimizerView(backend.optimizer)
            load_optimizer(entries, view, meta["optimizer"],
                           lambda kind, entry: saved_tensor(store, kind, entry, same, ctx))
            load_group_settings(view, state["optimizer"])
            backend.trained_schedule.load_state_dict(state["schedule"])
    finally:
        store.close()
    load_rng_state(state["rng"], backend.spec.device_policy)
    return {**meta, "resharded": not same, "rng_source_rank": source}
