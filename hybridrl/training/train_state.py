"""The train_state/ folder of a role checkpoint: a role's tensor state in model space, and reading it back.

One safetensors file per rank file position of the bridge's checkpoint (`layout.ModelRank`: TP x PP,
`state_tp00_pp000.safetensors`; for an expert-parallel model one per slot of a stage,
`state_tp00_pp000_ep001[_etp00].safetensors`), written by the first rank of that slot, with the keys
and shards of the model's files (`StateEntry`: one per tensor of this rank, keyed as in the bridge's
rank files). A slot's file holds its dense tensors only when it is their first holder (slot < TP,
i.e. DP/CP rank 0) and its experts only when it is theirs (slot < expert TP x EP, expert-DP rank 0):
those are the ranks a distributed optimizer gathers each kind's state to. A rank reads each tensor
from that holder's file (`layout.holder_slot`). Each key is prefixed by what it holds:
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
from hybridrl.models.layout import (
    ModelRank,
    ParallelLayout,
    hf_export_map,
    holder_slot,
    rank_chunk_key_prefix,
    rank_file_name,
)
from hybridrl.persistence import ROLE_CHECKPOINT_FILE, CheckpointError, RoleCheckpointError
from hybridrl.training.backend import MegatronBackend

STATE_DIR = "train_state"
PARAM = "param"
OUTPUT_LAYER = "output_layer.weight"
# the role checkpoint's metadata file, which lists every train_state file (`checkpointing.METADATA`)
METADATA = ROLE_CHECKPOINT_FILE


def state_file(layout: ParallelLayout, rank: ModelRank) -> str:
    """The train_state file of a rank file position: named like the bridge's rank file."""
    return "state_" + rank_file_name(layout, *rank).removeprefix("model_")


def holder_rank(layout: ParallelLayout, entry: StateEntry, ctx: Any) -> ModelRank:
    """The rank file position whose train_state file holds `entry` of this rank (same layout)."""
    local = ctx.rank % (ctx.world_size // ctx.pp)
    tp_rank, ep_rank, etp_rank = layout.slot_ranks(holder_slot(layout, local % layout.slots, entry.plan.expert))
    return ModelRank(tp_rank, ctx.pp_rank, ep_rank, etp_rank)


def saved_layout(meta: dict[str, Any]) -> ParallelLayout:
    """The model layout a role checkpoint's metadata records (`checkpointing._layout`)."""
    saved = meta["layout"]
    return ParallelLayout(tp=saved["tp"], pp=saved["pp"], vpp=saved["vpp"], ep=saved.get("ep", 1),
                          first_stage_layers=saved.get("first_stage_layers"),
                          last_stage_layers=saved.get("last_stage_layers"), etp=saved.get("etp"))


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
        self.layout = saved_layout(meta)
        self.shape = ModelShape(**meta["shape"])
        self._open = _SafetensorsFiles()
        self._keys: dict[str, set[str]] = {}
        self._pieces = hf_export_map(self.shape, self.layout)

    def handle(self, rank: ModelRank) -> Any:
        name = state_file(self.layout, rank)
        path = self.folder / name
        recorded = self.files.get(name)
        if recorded is None:
            raise RoleCheckpointError(f"{path} is not listed in the checkpoint's {METADATA}")
        if not path.is_file():
            raise RoleCheckpointError(f"{path} is missing (the first rank of each rank file position writes one)")
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

    def head_rank(self) -> ModelRank:
        """Where a value model's head (replicated over TP) is read from: the last stage's first slot."""
        return ModelRank(0, self.layout.pp - 1, 0, 0)

    def positions_for(self, entries: list[StateEntry]) -> set[ModelRank]:
        """The saved rank file positions whose files hold a part of these (new-layout) shards."""
        needed = set()
        for entry in entries:
            if entry.is_head:
                needed.add(self.head_rank())
                continue
            for seg in entry.plan.segments:
                if seg.hf_name is None:
                    continue
                for piece in self._pieces[seg.hf_name]:
                    if piece.axis is None or (piece.hf_start < seg.stop and seg.start < piece.hf_stop):
                        needed.add(piece.rank)
                        if piece.axis is None:
                            break  # a replicated tensor is read from its first holder
        return needed

    def verify(self, positions: set[ModelRank]) -> None:
        """Check the files of these positions before anything is loaded (listed files only: a
        checkpoint without optimizer state has none)."""
        for recorded in self.files.values():
            rank = self.layout_rank(recorded)
            if rank in positions:
                self.handle(rank)

    def layout_rank(self, recorded: dict[str, Any]) -> ModelRank:
        """The position a file's metadata entry records (EP, expert TP ranks only when used)."""
        tp_rank, pp_rank = recorded["tp_rank"], recorded["pp_rank"]
        ep_rank = recorded.get("ep_rank", 0)
        return ModelRank(tp_rank, pp_rank, ep_rank, recorded.get("etp_rank", tp_rank % self.layout.expert_tp))

    def own(self, kind: str, key: str, rank: ModelRank) -> torch.Tensor:
        handle = self.handle(rank)
        name = f"{kind}/{key}"
        if name not in self._keys[state_file(self.layout, rank)]:
            raise RoleCheckpointError(f"{self.folder / state_file(self.layout, rank)} lacks tensor {name}")
        return handle.get_tensor(name)

    def head(self, kind: str) -> torch.Tensor:
        """A value model's head (replicated over TP): as saved by the last stage's TP rank 0."""

        last = self.layout.num_chunks_per_stage - 1
        key = rank_chunk_key_prefix(self.layout, last if self.layout.vpp else None) + OUTPUT_LAYER
        return self.own(kind, key, self.head_rank())

    def assemble(self, kind: str, plan: Any) -> torch.Tensor:
        return assemble(KindReader(self, kind), plan)

    def close(self) -> None:
        self._open.close()


class KindReader:
    """`read(hf_name, axis, start, stop)` over one kind of train_state tensor (what `assemble` needs)."""

    def __init__(self, store: TrainState, kind: str) -> None:
        self.store, self.prefix = store, f"{kind}/"

    def read(self, hf_name: str, axis: int | None, start: int, stop: int) -> torch.Tensor:
        return read_pieces(self.store._pieces[hf_name], self.store.handle, axis, start, stop, self.prefix)


def saved_tensor(store: TrainState, kind: str, entry: StateEntry, same: bool, ctx: Any) -> torch.Tensor:
    """This rank's `kind` tensor for `entry`: its own saved shard, the whole head, or re-sharded."""
    if same:
        value = store.own(kind, entry.key, holder_rank(store.layout, entry, ctx))
    elif entry.is_head:
        value = store.head(kind)
    else:
        value = store.assemble(kind, entry.plan)
    if tuple(value.shape) != tuple(entry.param.shape):
        raise RoleCheckpointError(f"{kind} of {entry.key}: saved shape {list(value.shape)}, this model "
                                  f"{list(entry.param.shape)}")
    return value
