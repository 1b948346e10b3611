"""Where each parameter's optimizer state lives, and moving it to and from model space.

`OptimizerView` maps model parameters to (inner torch optimizer, main tensor, flat range) for
megatron-core 0.16's optimizers. Saving collects this rank's per-element state (`local_optimizer_state`)
and, for the distributed optimizer, gathers each parameter's DP shards whole to DP rank 0 of its group, or to
the ranks that ask for it (`gather_sharded`); loading puts each parameter's saved state back, whole or as this
rank's DP shard (`load_optimizer`), with the grad scaler and the param groups' stepping state, the groups'
hyper-parameters being the resumed job's (`rank_optimizer_meta` / `load_group_settings`).
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.parallel.device import collective_device
from hybridrl.persistence import RoleCheckpointError
from hybridrl.training.train_state import StateEntry

MAIN_PARAM = "main_param"
STEP = "step"
# torch param-group entries that select an implementation rather than set a hyper-parameter
GROUP_SWITCHES = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})
# how megatron tells its param groups apart (weight decay / lr multipliers, expert params)
GROUP_IDENTITY = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


def _optimizer_parts(optimizer: Any) -> list[Any]:
    parts = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    return [p for p in parts
            if getattr(p, "optimizer", None) is not None and not getattr(p, "is_stub_optimizer", False)]


@dataclass(frozen=True)
class Slot:
    inner: torch.optim.Optimizer
    main: torch.Tensor  # what the inner optimizer updates: the parameter, its fp32 master, or a DP shard of those
    start: int | None = None  # the flat range [start, stop) of the parameter `main` covers (distributed optimizer)
    stop: int | None = None

    def piece(self, full: torch.Tensor) -> torch.Tensor:
        """This slot's part of a parameter-shaped tensor, shaped like `main`."""
        if self.start is None:
            return full.reshape(self.main.shape)
        return full.reshape(-1)[self.start:self.stop]

    @property
    def flat_range(self) -> tuple[int, int]:
        """[start, stop) of a distributed optimizer's slot: its DP shard of the flattened parameter."""
        if self.start is None or self.stop is None:
            raise RoleCheckpointError("a whole parameter's optimizer slot has no DP shard range")
        return self.start, self.stop


class OptimizerView:
    """Maps model parameters to (inner torch optimizer, main tensor, flat range) for megatron-core 0.16's
    FP32Optimizer, Float16OptimizerWithFloat16Params (fp32 master in `param.main_param`) and
    DistributedOptimizer (`model_param_group_index_map`: this DP rank's shard of each parameter)."""

    def __init__(self, optimizer: Any) -> None:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        self.parts = _optimizer_parts(optimizer)
        self.distributed: list[Any] = []
        self._sharded: dict[int, Any] = {}  # id(model param) -> the DistributedOptimizer sharding it
        self._slots: dict[int, Slot] = {}
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
                    self._slots[id(param)] = Slot(inner, inner.param_groups[group]["params"][order],
                                                   owned.start, owned.end)
            else:
                self._plain.append((inner, {id(p) for g in inner.param_groups for p in g["params"]}))

    def sharded_by(self, param: torch.Tensor) -> Any:
        return self._sharded.get(id(param))

    def slot(self, entry: StateEntry) -> Slot | None:
        """Where `entry`'s state lives on this rank; None when another DP rank holds all of it."""
        found = self._slots.get(id(entry.param))
        if found is not None:
            return found
        if id(entry.param) in self._sharded:
            return None
        master = None if getattr(entry.param, "main_param_sharded", False) else getattr(entry.param, "main_param", None)
        for inner, ids in self._plain:
            if master is not None and id(master) in ids:
                return Slot(inner, master)
            if id(entry.param) in ids:
                return Slot(inner, entry.param)
        raise RoleCheckpointError(f"parameter {entry.key} is not updated by the role's optimizer")


def separate_master(slot: Slot, entry: StateEntry) -> bool:
    """The optimizer keeps its own (fp32) copy of this parameter: bf16/fp16 training."""
    return slot.main.dtype != entry.param.dtype


# ---- saving -------------------------------------------------------------------------------------------

def local_optimizer_state(entries: list[StateEntry], view: OptimizerView) -> tuple[dict[int, dict[str, torch.Tensor]],
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
        if separate_master(slot, entry):
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


def agreed_summaries(world_size: int, error: str | None, summary: Any) -> list[Any]:
    """Collective: every rank's summary, after every rank's local failure (`error`) is known to all, so that they
    raise together (RoleCheckpointError naming each failed rank) before any further collective."""
    summaries: list[Any] = [None] * world_size
    dist.all_gather_object(summaries, (error, summary))
    failed = [f"rank {r}: {e}" for r, (e, _) in enumerate(summaries) if e]
    if failed:
        raise RoleCheckpointError("; ".join(failed))
    return [s for _, s in summaries]


def optimizer_summary(summaries: list[dict[str, Any]]) -> dict[str, Any]:
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


def gather_sharded(entries: list[StateEntry], local: dict[int, dict[str, torch.Tensor]], view: OptimizerView,
                   kinds: dict[str, str], wanted: Collection[int] | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """Collective over each distributed optimizer's own DP group (megatron's ChainedOptimizer: the dense one's
    DP x CP group, the expert one's expert data-parallel group): the full state of the parameters it shards, on the
    ranks that want it, empty elsewhere. `wanted`: the entries (indices) this rank wants whole; None: DP rank 0 of
    each group wants every one the group shards. The ranks of a group first tell each other what they want and own;
    then each wanting rank gathers the shards of what it wants alone (the others send), and a group none of whose
    ranks wants anything sends nothing. Each DP rank owns a contiguous flat range of a parameter. A coverage error is
    raised only after every collective ran (peers never wait on a failed rank)."""
    full: dict[int, dict[str, torch.Tensor]] = {}
    problems: list[str] = []
    for part in view.distributed:
        group = getattr(part, "data_parallel_group_gloo", None) or part.data_parallel_group
        device = collective_device(group)
        size, group_rank = dist.get_world_size(group), dist.get_rank(group)
        members = [i for i, e in enumerate(entries) if view.sharded_by(e.param) is part]
        slots = {i: view.slot(entries[i]) for i in members}
        if wanted is None:
            wants = members if group_rank == 0 else []
        else:
            wants = [i for i in members if i in wanted]
        owned = {kind: [(i, *s.flat_range) for i, s in slots.items() if s is not None and kind in local[i]]
                 for kind in kinds}
        said: list[Any] = [None] * size  # each rank's (wants, owned): the same plan on every rank of the group
        dist.all_gather_object(said, (wants, owned), group=group)
        for dst_group_rank, (their_wants, _) in enumerate(said):
            if not their_wants:
                continue
            receives, wanted_there = dst_group_rank == group_rank, set(their_wants)
            dst = dist.get_global_rank(group, dst_group_rank)
            for kind, dtype_name in kinds.items():
                dtype = getattr(torch, dtype_name)
                # each rank's pieces of what the destination wants, in the order the destination reads them
                pieces = [[p for p in their_owned[kind] if p[0] in wanted_there] for _, their_owned in said]
                width = max(sum(stop - start for _, start, stop in mine) for mine in pieces)
                if width == 0:  # nobody holds any of it (the caller finds it missing)
                    continue
                send = torch.zeros(width, dtype=dtype, device=device)
                offset = 0
                for i, start, stop in pieces[group_rank]:
                    send[offset:offset + stop - start] = local[i][kind].reshape(-1).to(device)
                    offset += stop - start
                received = [torch.empty(width, dtype=dtype, device=device) for _ in range(size)] if receives else None
                dist.gather(send, received, dst=dst, group=group)
                if received is None:  # sent
                    continue
                covered: dict[int, int] = {}
                for theirs, chunk in zip(pieces, received):
                    offset = 0
                    for i, start, stop in theirs:
                        target = full.setdefault(i, {}).setdefault(
                            kind, torch.empty(entries[i].param.numel(), dtype=dtype))
                        target[start:stop] = chunk[offset:offset + stop - start].cpu()
                        offset += stop - start
                        covered[i] = covered.get(i, 0) + stop - start
                problems += [f"{kind} of {entries[i].key}: DP shards cover {n} of {entries[i].param.numel()} "
                             "elements" for i, n in covered.items() if n != entries[i].param.numel()]
    if problems:
        raise RoleCheckpointError("distributed optimizer state does not gather whole: " + "; ".join(problems[:4]))
    return {i: {k: t.reshape(entries[i].param.shape) for k, t in by_kind.items()} for i, by_kind in full.items()}


def rank_optimizer_meta(view: OptimizerView | None) -> dict[str, Any] | None:
    if view is None:
        return None
    parts = []
    for part in view.parts:
        scaler = getattr(part, "grad_scaler", None)
        parts.append({
            "param_groups": [{k: v for k, v in g.items() if k not in GROUP_SWITCHES}
                             for g in part.optimizer.param_groups],
            "grad_scaler": scaler.state_dict() if scaler is not None else None,
        })
    return {"parts": parts}


# ---- loading ------------------------------------------------------------------------------------------

@torch.no_grad()
def load_optimizer(entries: list[StateEntry], view: OptimizerView, described: dict[str, Any],
                   full: Callable[[str, StateEntry], torch.Tensor]) -> None:
    """Each parameter's saved state (`full(kind, entry)`: the whole parameter-shaped tensor) put back
    into the optimizer, as this rank's part of it; `described` is the checkpoint's optimizer summary."""
    kinds, step = described["kinds"], described["step"]
    for part in view.parts:
        part.optimizer.state.clear()
    for entry in entries:
        slot = view.slot(entry)
        if slot is None:
            continue
        if separate_master(slot, entry):
            master = full(MAIN_PARAM, entry) if step is not None and MAIN_PARAM in kinds else entry.param.detach()
            slot.main.copy_(slot.piece(master))
        if step is None:
            continue
        state: dict[str, torch.Tensor] = {STEP: torch.tensor(step, dtype=getattr(torch, described["step_dtype"]))}
        for kind in kinds:
            if kind != MAIN_PARAM:
                state[kind] = slot.piece(full(kind, entry)).to(slot.main.device, copy=True)
        slot.inner.state[slot.main] = state


def load_group_settings(view: OptimizerView, saved: dict[str, Any] | None) -> None:
    """The grad scaler and what a param group gained while stepping (by megatron's group identity), per optimizer
    part: the entries the freshly built group lacks, such as TE's and Apex's FusedAdam per-group `step`. The group's
    own entries (betas, eps, weight_decay, lr, ...) are this job's optimizer settings and stay: a resumed job may
    change them (they were overwritten with the checkpoint's, so new betas or eps were silently ignored)."""
    if saved is None:
        return
    for part, saved_part in zip(view.parts, saved["parts"]):
        by_identity = {tuple(g.get(k) for k in GROUP_IDENTITY): g for g in saved_part["param_groups"]}
        for group in part.optimizer.param_groups:
            match = by_identity.get(tuple(group.get(k) for k in GROUP_IDENTITY))
            if match is not None:
                group.update({k: v for k, v in match.items() if k not in GROUP_SWITCHES and k not in group})
        scaler = getattr(part, "grad_scaler", None)
        if scaler is not None and saved_part["grad_scaler"] is not None:
            scaler.load_state_dict(saved_part["grad_scaler"])
