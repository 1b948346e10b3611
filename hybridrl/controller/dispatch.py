"""Explicit dispatch: which rank of a worker group receives what, and whose results count.

Plain functions over a `RankMesh` (each rank's dp/tp/pp/cp coordinates). The worker group calls
them; a reader can follow one step's data movement without decorators or registered modes:

* `dispatch_by_dp(batch, mesh)`: split the batch into one chunk per data-parallel rank; the TP/PP/
  CP peers of a DP rank receive the same chunk (one `ray.put` per chunk, peers share the object).
* `collect_from_output_ranks(results, mesh)`: keep the results of the ranks that own an output
  (last pipeline stage, TP rank 0, CP rank 0) and concatenate them in DP order.
* `balanced_dp_order(tokens, dp_size, mini_batches)`: a row order under which the even split
  gives every DP rank the same number of rows and nearly the same number of real tokens
  (`trainer.balance_batch`); `WorkerGroup.call_by_dp` dispatches in that order and puts the results
  back in the batch's own order. `dp_token_imbalance` measures a split (`perf/dp_token_imbalance`).
* `one_to_all(...)`: the same arguments to every rank. `all_to_all(...)`: one set per rank.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch

from hybridrl.data.balance import balanced_partition
from hybridrl.data.batch import Batch

MESH_AXES = ("tp", "cp", "dp", "pp")
# megatron-core 0.16.1 parallel_state.initialize_model_parallel(order="tp-cp-ep-dp-pp"): the first
# axis varies fastest. Expert parallelism lives in a separate generator for the dense decoder.
MEGATRON_DEFAULT_ORDER = "tp-cp-ep-dp-pp"


@dataclass(frozen=True, order=True)
class MeshCoord:
    """A rank's position in its worker group's mesh (duck-compatible with config's RankCoord)."""

    dp: int
    tp: int = 0
    pp: int = 0
    cp: int = 0


def _as_coord(value: Any, rank: int) -> MeshCoord:
    if isinstance(value, MeshCoord):
        return value
    if isinstance(value, Mapping):
        unknown = set(value) - set(MESH_AXES) - {"rank"}
        if unknown:
            raise ValueError(f"rank {rank}: unknown mesh axes {sorted(unknown)}; known: {MESH_AXES}")
        return MeshCoord(**{axis: int(value.get(axis, 0)) for axis in MESH_AXES})
    if all(hasattr(value, axis) for axis in ("dp", "tp", "pp")):
        return MeshCoord(**{axis: int(getattr(value, axis, 0)) for axis in MESH_AXES})
    raise TypeError(f"rank {rank}: cannot read mesh coordinates from {value!r}")


@dataclass(frozen=True)
class RankMesh:
    """Coordinates of every rank of a worker group; `coords[r]` belongs to group rank r."""

    coords: tuple[MeshCoord, ...]
    sizes: Mapping[str, int] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        coords = tuple(_as_coord(c, r) for r, c in enumerate(self.coords))
        object.__setattr__(self, "coords", coords)
        if not coords:
            raise ValueError("a mesh needs at least one rank")
        for rank, coord in enumerate(coords):
            negative = [a for a in MESH_AXES if getattr(coord, a) < 0]
            if negative:
                raise ValueError(f"rank {rank} has negative coordinates on {negative}: {coord}")
        sizes = {axis: 1 + max(getattr(c, axis) for c in coords) for axis in MESH_AXES}
        object.__setattr__(self, "sizes", sizes)
        expected = int(np.prod(list(sizes.values())))
        seen: dict[MeshCoord, int] = {}
        for rank, coord in enumerate(coords):
            if coord in seen:
                raise ValueError(f"ranks {seen[coord]} and {rank} have the same coordinates {coord}")
            seen[coord] = rank
        if expected != len(coords):
            raise ValueError(
                f"coordinates of {len(coords)} ranks do not fill a mesh of sizes {sizes} "
                f"({expected} positions); some positions are missing"
            )

    @classmethod
    def from_coords(cls, coords: Sequence[Any]) -> RankMesh:
        """From per-rank coordinates: MeshCoord, mappings, or objects with dp/tp/pp(/cp) attributes."""
        return cls(tuple(coords))

    @classmethod
    def from_sizes(
        cls, *, tp: int = 1, pp: int = 1, dp: int = 1, cp: int = 1, order: str = MEGATRON_DEFAULT_ORDER
    ) -> RankMesh:
        """Rank r's coordinates under `order` (first axis fastest), as megatron-core assigns them."""
        sizes = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": 1}
        bad = {k: v for k, v in sizes.items() if v <= 0}
        if bad:
            raise ValueError(f"mesh sizes must be positive: {bad}")
        axes = order.lower().split("-")
        unknown = set(axes) - set(sizes)
        if unknown or len(set(axes)) != len(axes):
            raise ValueError(f"order {order!r}: each axis of {MESH_AXES} (or ep) at most once")
        # Like megatron's RankGenerator: an axis of size 1 may be left out (it goes last).
        missing = [a for a in MESH_AXES if a not in axes]
        if any(sizes[a] != 1 for a in missing):
            raise ValueError(f"order {order!r} leaves out {missing}, but sizes are {sizes}")
        axes += missing
        world = tp * pp * dp * cp
        coords = []
        for rank in range(world):
            position, rest = {}, rank
            for axis in axes:
                position[axis] = rest % sizes[axis]
                rest //= sizes[axis]
            position.pop("ep", None)
            coords.append(MeshCoord(**position))
        return cls(tuple(coords))

    @property
    def world_size(self) -> int:
        return len(self.coords)

    @property
    def dp_size(self) -> int:
        return self.sizes["dp"]

    def ranks_of_dp(self, dp_rank: int) -> list[int]:
        """All ranks (TP/PP/CP peers) that work on DP chunk `dp_rank`."""
        return [r for r, c in enumerate(self.coords) if c.dp == dp_rank]

    def is_output_rank(self, rank: int) -> bool:
        coord = self.coords[rank]
        return coord.pp == self.sizes["pp"] - 1 and coord.tp == 0 and coord.cp == 0

    def output_ranks(self) -> list[int]:
        """The rank that owns each DP chunk's output, in DP order."""
        by_dp = {self.coords[r].dp: r for r in range(self.world_size) if self.is_output_rank(r)}
        return [by_dp[d] for d in range(self.dp_size)]


@dataclass(frozen=True)
class RankCall:
    """Positional and keyword arguments of one rank's method call."""

    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)


def dispatch_by_dp(batch: Batch, mesh: RankMesh) -> list[ray.ObjectRef]:
    """One object ref per rank: the batch chunk of that rank's DP index.

    The batch must split evenly (`Batch.pad_to_multiple(mesh.dp_size)` first otherwise). Each chunk
    is serialized once; its TP/PP/CP peers get the same ref, which Ray resolves to the chunk before
    the method runs (zero-copy reads from the node's object store).
    """
    chunks = batch.split(mesh.dp_size)
    chunk_refs = [ray.put(chunk) for chunk in chunks]
    return [chunk_refs[coord.dp] for coord in mesh.coords]


def row_tokens(batch: Batch) -> np.ndarray:
    """Real tokens (prompt + response) of each row: what a packed or trimmed pass of the row costs."""
    return (batch["attention_mask"] != 0).sum(-1).numpy().astype(np.int64)


def row_prompt_tokens(batch: Batch) -> np.ndarray:
    """Real prompt tokens of each row (the columns before the responses)."""
    width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    return (batch["attention_mask"][:, :width] != 0).sum(-1).numpy().astype(np.int64)


def _whole_groups(rows: list[int], labels: Sequence[Any], per_rank: int) -> list[list[int]] | None:
    """`rows` (one global mini-batch) as its groups of equal `labels`, in the order of each group's first
    row, when they can be dealt whole: every group has the same size and it divides `per_rank`; else None."""
    groups: dict[Any, list[int]] = {}
    for row in rows:
        groups.setdefault(labels[row], []).append(row)
    sizes = {len(g) for g in groups.values()}
    if len(sizes) != 1 or per_rank % next(iter(sizes)):
        return None
    return list(groups.values())


def _dealt_units(rows: list[int], values: np.ndarray, labels: Sequence[Any] | None, prompts: np.ndarray | None,
                 per_rank: int) -> tuple[list[list[int]], list[int]]:
    """The units `rows` (one global mini-batch) are dealt in, and their tokens: its groups of equal `labels`, each
    costing its prompt once plus its rows' responses, where they can be dealt whole; else its rows one by one."""
    if labels is not None and prompts is not None:
        units = _whole_groups(rows, labels, per_rank)
        if units is not None:
            return units, [int(values[u].sum() - (len(u) - 1) * prompts[u[0]]) for u in units]
    return [[row] for row in rows], values[rows].tolist()


def _dp_groups(rows: int, dp_size: int, mini_batches: int) -> list[list[int]]:
    """The rows of each global mini-batch under the plain split: rank d's chunk is rows
    [d*C, (d+1)*C) and its k-th mini-batch the k-th of `mini_batches` equal slices of that."""
    if dp_size < 1 or mini_batches < 1:
        raise ValueError(f"dp_size and mini_batches must be >= 1, got {dp_size} and {mini_batches}")
    if rows % (dp_size * mini_batches):
        raise ValueError(f"{rows} rows do not split into {dp_size} DP chunks of {mini_batches} equal mini-batches")
    chunk, per_mini = rows // dp_size, rows // (dp_size * mini_batches)
    return [[d * chunk + k * per_mini + j for d in range(dp_size) for j in range(per_mini)]
            for k in range(mini_batches)]


def balanced_dp_order(tokens: Sequence[int] | np.ndarray, dp_size: int, mini_batches: int = 1,
                      groups: Sequence[Any] | None = None,
                      prompt_tokens: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """A permutation `order` (row i of the dispatched batch is row order[i]) whose even split over
    `dp_size` ranks gives each rank the same row count and balanced real tokens.

    Each global mini-batch keeps its rows (the update's optimizer steps see the same samples as with
    the plain split; only which rank holds which of them changes): mini-batch k's rows are split
    into `dp_size` equal-size groups by `balanced_partition(..., equal_size=True)`, and the groups
    go heaviest first to the ranks that hold the fewest tokens so far, so the whole chunks stay
    balanced too. Rows keep their relative order inside a rank's mini-batch.

    `groups` (a label per row, e.g. `uid`: rows sharing a prompt, which a worker with
    `model.shared_prefix` computes once for those of them in one micro-batch) and `prompt_tokens`: a
    mini-batch whose groups all have the same size, dividing a rank's share, is dealt in whole groups,
    each costing its prompt once plus its rows' responses, and a group's rows stay next to each other;
    another mini-batch is dealt row by row as without.
    """
    values = np.asarray(tokens, dtype=np.int64)
    prompts = None if prompt_tokens is None else np.asarray(prompt_tokens, dtype=np.int64)
    if groups is not None and (prompts is None or len(groups) != len(values) or len(prompts) != len(values)):
        raise ValueError("groups needs prompt_tokens, and both one entry per row")
    per_rank: list[list[int]] = [[] for _ in range(dp_size)]
    loads = [0] * dp_size
    for group in _dp_groups(len(values), dp_size, mini_batches):
        units, costs = _dealt_units(group, values, groups, prompts, len(group) // dp_size)
        parts = balanced_partition(costs, dp_size, equal_size=True)  # heaviest first
        free = sorted(range(dp_size), key=lambda d: (loads[d], d))
        for rank, part in zip(free, parts):
            per_rank[rank].extend(row for i in part for row in units[i])
            loads[rank] += sum(costs[i] for i in part)
    return np.asarray([row for rows in per_rank for row in rows], dtype=np.int64)


def dispatch_order(batch: Batch, dp_size: int, mini_batches: int, keep_together: str | None = None) -> np.ndarray:
    """`balanced_dp_order` of `batch`'s rows; with `keep_together` (a non-tensor column, e.g. `uid`) its
    equal values as `groups`, costed with each row's prompt tokens (a missing column: row by row)."""
    labels = batch.non_tensors.get(keep_together) if keep_together else None
    if labels is None:
        return balanced_dp_order(row_tokens(batch), dp_size, mini_batches)
    return balanced_dp_order(row_tokens(batch), dp_size, mini_batches, groups=labels.tolist(),
                             prompt_tokens=row_prompt_tokens(batch))


def dp_token_imbalance(tokens: Sequence[int] | np.ndarray, dp_size: int, mini_batches: int = 1,
                       order: Sequence[int] | np.ndarray | None = None) -> float:
    """How long the DP group runs against a perfect balance: the sum over mini-batches of the heaviest
    rank's tokens over the sum of their means (max rank tokens / mean rank tokens with one
    mini-batch). 1.0 is perfect; `order` is the dispatch order (None: the plain split)."""
    values = np.asarray(tokens, dtype=np.int64)
    if order is not None:
        values = values[np.asarray(order, dtype=np.int64)]
    per_mini = len(values) // (dp_size * mini_batches)
    worst = mean = 0.0
    for group in _dp_groups(len(values), dp_size, mini_batches):
        loads = values[group].reshape(dp_size, per_mini).sum(-1)
        worst += float(loads.max())
        mean += float(loads.mean())
    return worst / mean if mean else 1.0


def select_output_ranks(results: Sequence[Any], mesh: RankMesh) -> list[Any]:
    """The results of the output-owning ranks, in DP order (for non-batch results like metrics)."""
    if len(results) != mesh.world_size:
        raise ValueError(f"got {len(results)} results for a mesh of {mesh.world_size} ranks")
    return [results[r] for r in mesh.output_ranks()]


def collect_from_output_ranks(results: Sequence[Any], mesh: RankMesh) -> Batch:
    """Concatenate the output ranks' batches in DP order (the inverse of `dispatch_by_dp`)."""
    outputs = select_output_ranks(results, mesh)
    for dp_rank, (rank, out) in enumerate(zip(mesh.output_ranks(), outputs)):
        if not isinstance(out, Batch):
            raise TypeError(
                f"rank {rank} (output rank of dp {dp_rank}) returned {type(out).__name__}, expected a Batch"
            )
    return Batch.concat(outputs)


def _share_if_bulky(value: Any) -> Any:
    # Top-level ObjectRef arguments are resolved by Ray before the call, so every rank sees the
    # value while it is serialized once. Small values are cheaper inline.
    if isinstance(value, (Batch, np.ndarray, torch.Tensor)):
        return ray.put(value)
    return value


def one_to_all(*args: Any, world_size: int, **kwargs: Any) -> list[RankCall]:
    """The same call for every rank. Batches, arrays and tensors are put in the object store once."""
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    call = RankCall(
        tuple(_share_if_bulky(a) for a in args), {k: _share_if_bulky(v) for k, v in kwargs.items()}
    )
    return [call] * world_size


def all_to_all(per_rank_args: Sequence[RankCall | tuple], world_size: int) -> list[RankCall]:
    """One call per rank: each item is a RankCall or a tuple of positional arguments."""
    if len(per_rank_args) != world_size:
        raise ValueError(f"got arguments for {len(per_rank_args)} ranks, the group has {world_size}")
    calls = []
    for rank, item in enumerate(per_rank_args):
        if isinstance(item, RankCall):
            calls.append(item)
        elif isinstance(item, tuple):
            calls.append(RankCall(item))
        else:
            raise TypeError(
                f"rank {rank}: expected a RankCall or a tuple of positional arguments, "
                f"got {type(item).__name__}"
            )
    return calls
