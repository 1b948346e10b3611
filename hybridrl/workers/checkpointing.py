"""Save and restore one role's full training state, per rank, atomically: resume gives the same next step.

Folder layout (written by every rank of the role's group together: a collective):
  model/                the bridge's megatron checkpoint (policy roles): one safetensors file per
                        TP x PP rank, checksummed, readable by `load_weights` and `hybridrl convert`
  rank_00003.pt         per rank: optimizer (the inner torch optimizer's state and the parameters it
                        updates, i.e. fp32 master copies or distributed-optimizer shards), LR
                        schedule, RNG streams (torch, python, numpy, megatron's tracker, CUDA), and,
                        for value models (whose scalar head the bridge format has no place for), the
                        rank's model weights
  role_checkpoint.json  role, layout and world size, written last
Everything is written into a hidden staging folder next to the target, which rank 0 renames into
place once every rank has succeeded; a crash leaves the previous checkpoint untouched. Rank files
are plain tensors and containers, loaded with `torch.load(weights_only=True)` (no pickled code);
each has a `rank_NNNNN.pt.sha256` next to it, checked before loading (a tampered or truncated file
is named in the error instead of failing somewhere inside torch's unpickler).

Restoring needs the same layout and world size (the optimizer state is sharded per rank).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hybridrl.workers.megatron_role import MegatronRole

METADATA = "role_checkpoint.json"
MODEL_DIR = "model"
FORMAT = "hybridrl-role-checkpoint"


class RoleCheckpointError(RuntimeError):
    """A role checkpoint is missing, incomplete, or was written for another layout."""


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _all_ok(ok: bool, detail: str) -> None:
    statuses: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(statuses, (ok, detail))
    failed = [f"rank {r}: {d}" for r, (good, d) in enumerate(statuses) if not good]
    if failed:
        raise RoleCheckpointError("role checkpoint failed on " + "; ".join(failed))


def _optimizer_parts(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_state(optimizer: Any) -> list[dict[str, Any]]:
    parts = []
    for part in _optimizer_parts(optimizer):
        inner = part.optimizer
        scaler = getattr(part, "grad_scaler", None)
        parts.append({
            "inner": inner.state_dict(),
            "main_params": [p.detach().clone() for group in inner.param_groups for p in group["params"]],
            "grad_scaler": scaler.state_dict() if scaler is not None else None,
        })
    return parts


@torch.no_grad()
def load_optimizer_state(optimizer: Any, parts: list[dict[str, Any]]) -> None:
    own = _optimizer_parts(optimizer)
    if len(own) != len(parts):
        raise RoleCheckpointError(f"checkpoint has {len(parts)} optimizer parts, this optimizer {len(own)}")
    for part, saved in zip(own, parts):
        inner = part.optimizer
        params = [p for group in inner.param_groups for p in group["params"]]
        if len(params) != len(saved["main_params"]):
            raise RoleCheckpointError("optimizer parameter count differs from the checkpoint (another layout?)")
        for param, value in zip(params, saved["main_params"]):
            if param.shape != value.shape:
                raise RoleCheckpointError(f"optimizer parameter of shape {list(param.shape)} saved as "
                                          f"{list(value.shape)} (another layout?)")
            param.copy_(value)
        inner.load_state_dict(saved["inner"])
        scaler = getattr(part, "grad_scaler", None)
        if scaler is not None and saved["grad_scaler"] is not None:
            scaler.load_state_dict(saved["grad_scaler"])


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


def _value_model_weights(engine: MegatronRole) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": v.detach().cpu().clone() for i, chunk in enumerate(engine.chunks)
            for k, v in chunk.state_dict().items() if not k.endswith("_extra_state") and v is not None}


def save_role_checkpoint(engine: MegatronRole, out_dir: str | Path) -> Path:
    """Collective over the role's group: write this rank's state into `out_dir` (replaced if present)."""
    from hybridrl.models.bridge import save_mcore_checkpoint
    from hybridrl.models.checkpoint import commit_staging_dir, make_staging_dir

    ctx = engine.ctx
    out_dir = Path(out_dir).absolute()
    holder: list[Any] = [None]
    if ctx.rank == 0:
        try:
            holder[0] = str(make_staging_dir(out_dir, force=True))
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            holder[0] = exc
    dist.broadcast_object_list(holder, src=0)
    if isinstance(holder[0], Exception):
        raise RoleCheckpointError(str(holder[0]))
    staging = Path(holder[0])
    ok, detail = True, ""
    try:
        if not engine.spec.value_head:
            save_mcore_checkpoint(engine.chunks, staging / MODEL_DIR, ctx=ctx)
        state: dict[str, Any] = {
            "role": engine.spec.role, "rank": ctx.rank,
            "rng": rng_state(ctx.device),
            "optimizer": optimizer_state(engine.optimizer) if engine.optimizer is not None else None,
            "schedule": engine.schedule.state_dict() if engine.schedule is not None else None,
            "weights": _value_model_weights(engine) if engine.spec.value_head else None,
        }
        target = staging / rank_file(ctx.rank)
        partial_file = target.with_suffix(".tmp")
        torch.save(state, partial_file)
        os.replace(partial_file, target)
        (staging / (target.name + ".sha256")).write_text(_file_sha256(target) + "\n")
    except Exception as exc:  # noqa: BLE001
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    try:
        _all_ok(ok, detail)
        if ctx.rank == 0:
            meta = {"format": FORMAT, "role": engine.spec.role, "world_size": ctx.world_size,
                    "layout": {"tp": ctx.tp, "pp": ctx.pp, "cp": ctx.cp, "dp": ctx.dp, "vpp": ctx.vpp},
                    "optimizer_steps": engine.schedule.step_count if engine.schedule is not None else 0}
            (staging / METADATA).write_text(json.dumps(meta, indent=1))
            commit_staging_dir(staging, out_dir)
        dist.barrier()
    except BaseException:
        if ctx.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


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


def load_role_checkpoint(engine: MegatronRole, ckpt_dir: str | Path) -> dict[str, Any]:
    """Restore weights, optimizer, schedule and RNG saved by `save_role_checkpoint` (same layout)."""
    from hybridrl.models.bridge import load_weights

    ctx = engine.ctx
    ckpt_dir = Path(ckpt_dir)
    meta_path = ckpt_dir / METADATA
    if not meta_path.is_file():
        raise RoleCheckpointError(f"{ckpt_dir} is not a complete role checkpoint (no {METADATA})")
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as exc:
        raise RoleCheckpointError(f"{meta_path} is not valid JSON ({exc})") from exc
    layout = {"tp": ctx.tp, "pp": ctx.pp, "cp": ctx.cp, "dp": ctx.dp, "vpp": ctx.vpp}
    if meta["role"] != engine.spec.role or meta["layout"] != layout or meta["world_size"] != ctx.world_size:
        raise RoleCheckpointError(f"{ckpt_dir} holds role {meta['role']} with layout {meta['layout']} on "
                                  f"{meta['world_size']} ranks; this is {engine.spec.role} with {layout} on "
                                  f"{ctx.world_size}")
    state = _load_rank_file(ckpt_dir / rank_file(ctx.rank))
    if engine.spec.value_head:
        with torch.no_grad():
            for i, chunk in enumerate(engine.chunks):
                for key, value in chunk.state_dict(keep_vars=True).items():
                    if not key.endswith("_extra_state") and value is not None:
                        value.copy_(state["weights"][f"{i}.{key}"])
    else:
        load_weights(engine.chunks, ckpt_dir / MODEL_DIR)
    if engine.optimizer is not None:
        load_optimizer_state(engine.optimizer, state["optimizer"])
        engine.schedule.load_state_dict(state["schedule"])
    load_rng_state(state["rng"], ctx.device)
    return meta
