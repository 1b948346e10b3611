"""The train_state/ folder of a role checkpoint: a role's tensor state in model space, and reading it back.

One safetensors file per TP x PP rank (`state_tp00_pp000.safetensors`), written by DP rank 0 of
that position, with exactly the keys and shards of the model's files (`StateEntry`: one per tensor
of this rank, keyed as in the bridge's rank files), prefixed by what they hold:
  param/<key>       the weights of value models (critic: the bridge format has no place for the
                    scalar head)
  main_param/<key>  the optimizer's fp32 master copy, when it differs from the model parameter
  exp_avg/<key>, exp_avg_sq/<key>   Adam's moments (momentum_buffer/<key>: SGD)

`TrainState` reads a rank's own shards as saved, or any tensor of another layout's shard assembled
from the saved shards by the same tensor plans the weights use (`hybridrl.models.layout`,
`checkpoint.read_pieces` + `assemble`). Each file is verified (per-tensor sha256) on first use. A
value model's scalar head is replicated over TP and read from the last stage's TP rank 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridrl.models.arch import ModelShape
from hybridrl.models.bridge import rank_tensor_entries
from hybridrl.models.checkpoint import _SafetensorsFiles, assemble, read_pieces, tensor_sha256
from hybridrl.models.layout import ParallelLayout, hf_export_map, rank_chunk_key_prefix
from hybridrl.persistence import CheckpointError, RoleCheckpointError
from hybridrl.training.backend import MegatronBackend

STATE_DIR = "train_state"
PARAM = "param"
OUTPUT_LAYER = "output_layer.weight"
# the role checkpoint's metadata file, which lists every train_state file (`checkpointing.METADATA`)
METADATA = "role_checkpoint.json"


def state_file(tp_rank: int, pp_rank: int) -> str:
    return f"state_tp{tp_rank:02d}_pp{pp_rank:03d}.safetensors"


# ---- the model's tensors, keyed as in the bridge's rank files -----------------------------------------

@dataclass(frozen=True)
class StateEntry:
    key: str  # key inside a rank's file (VPP chunks prefixed), as in the bridge's megatron checkpoint
    plan: Any  # layout.TensorPlan: which HF ranges make this shard
    param: torch.Tensor  # the model parameter itself
    is_head: bool  # a value model's scalar head: replicated over TP, outside the layout math


def state_entries(backend: MegatronBackend) -> list[StateEntry]:
    return [StateEntry(key, plan, param, backend.spec.value_head and plan.name == OUTPUT_LAYER)
            for key, plan, param in rank_tensor_entries(backend.chunks)]


# ---- reading ------------------------------------------------------------------------------------------

class TrainState:
    """The train_state/ files: a rank's own shards as saved, or any tensor of another layout's shard
    assembled from them through the layout math. Each file is verified (per-tensor sha256) on first use."""

    def __init__(self, folder: Path, meta: dict[str, Any]) -> None:
        self.folder = folder
        self.files: dict[str, Any] = meta.get("train_state", {})
        saved = meta["layout"]
        self.layout = ParallelLayout(tp=saved["tp"], pp=saved["pp"], vpp=saved["vpp"],
                                     first_stage_layers=saved.get("first_stage_layers"),
                                     last_stage_layers=saved.get("last_stage_layers"))
        self.shape = ModelShape(**meta["shape"])
        self._open = _SafetensorsFiles()
        self._keys: dict[str, set[str]] = {}
        self._pieces = hf_export_map(self.shape, self.layout)

    def handle(self, tp_rank: int, pp_rank: int, ep_rank: int = 0, etp_rank: int | None = None) -> Any:
        if ep_rank or etp_rank not in (None, tp_rank):
            raise RoleCheckpointError("role checkpoints of expert-parallel (ep > 1) models are not supported yet")
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

    def positions_for(self, entries: list[StateEntry]) -> set[tuple[int, int]]:
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

        last = self.layout.num_chunks_per_stage - 1
        key = rank_chunk_key_prefix(self.layout, last if self.layout.vpp else None) + OUTPUT_LAYER
        return self.own(kind, key, 0, self.layout.pp - 1)

    def assemble(self, kind: str, plan: Any) -> torch.Tensor:
        return assemble(KindReader(self, kind), plan)

    def close(self) -> None:
        self._open.close()


class KindReader:
    """`read(hf_name, axis, start, stop)` over one kind of train_state tensor (what `assemble` needs)."""

    def __init__(self, store: TrainState, kind: str) -> None:
        self.store, self.prefix = store, f"{kind}/"

    def read(self, hf_name: str, axis: int | None, start: int, stop: int) -> torch.Tensor:
        return read_pieces(self.store._pieces[hf_name], lambda rank: self.store.handle(*rank), axis, start, stop,
                           self.prefix)


def saved_tensor(store: TrainState, kind: str, entry: StateEntry, same: bool, ctx: Any) -> torch.Tensor:
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
