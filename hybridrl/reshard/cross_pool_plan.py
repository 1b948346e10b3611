"""Who sends which megatron ranges to which vLLM rank when the rollout runs on its own ranks
(`rollout.mode: disaggregated`): the cross-pool weight sync, planned.

Pure (no torch, no process groups), like `reshard_plan`, and built from the same pieces: the family's
weight table through `shard_ranges` (what each training rank holds) and `vllm_targets` (what each
vLLM rank needs), matched range by range with `match_target`, cut into buckets with `bucketize`.

Members of the cross-pool group are numbered trainer first (`parallel.cross_group`): training rank
r is member r, rollout rank q is member T + q (T = the training world). Rollout replica i is rollout
ranks [i * infer_tp, (i + 1) * infer_tp), its vLLM TP rank j = q % infer_tp (vLLM's own consecutive
groups).

Every range a vLLM rank needs comes straight from a training rank that holds it: no rank forwards
what it does not own, and no rank gathers the full model. A rollout rank receives exactly its shard
(the least it can: it holds nothing), once. Among the holders of a range (its DP/CP copies, the tied
embedding's copy on the last stage) the least loaded so far sends it, so the sending is spread over
every training rank; `balanced_send_numel` is the bound the heaviest sender is measured against (the
bytes of all shards over the training ranks).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from math import ceil, prod

from hybridrl.config.meshes import TrainingMesh
from hybridrl.models.arch import ModelShape
from hybridrl.models.layout import hf_tensor_shapes
from hybridrl.models.vllm_layout import vllm_targets
from hybridrl.reshard.reshard_plan import (
    Holding,
    Piece,
    RankReshardPlan,
    bucketize,
    expert_domain,
    match_target,
    megatron_holdings,
    rank_view,
    split_piece,
)


@dataclass(frozen=True)
class CrossPoolLayout:
    """The two sides of a cross-pool sync: the training mesh and the rollout pool's replicas."""

    mesh: TrainingMesh
    rollout_world: int
    infer_tp: int
    ep: int = 1
    use_tied_copy: bool = True

    def __post_init__(self) -> None:
        if self.infer_tp < 1 or self.rollout_world % self.infer_tp:
            raise ValueError(f"inference TP {self.infer_tp} does not divide the rollout pool's "
                             f"{self.rollout_world} ranks")

    @property
    def trainer_world(self) -> int:
        return self.mesh.world_size

    @property
    def size(self) -> int:
        return self.trainer_world + self.rollout_world

    def rollout_member(self, rollout_rank: int) -> int:
        return self.trainer_world + rollout_rank

    def gen_tp_index(self, member: int) -> int | None:
        """The vLLM TP rank of a rollout member (None for a training member)."""
        if member < self.trainer_world:
            return None
        return self.rollout_tp_index(member - self.trainer_world)

    def rollout_tp_index(self, rollout_rank: int) -> int:
        """The vLLM TP rank of rollout rank `rollout_rank`."""
        return rollout_rank % self.infer_tp


def all_holdings(shape: ModelShape, mesh: TrainingMesh, ep: int, use_tied_copy: bool) -> dict[str, list[Holding]]:
    """HF name -> every megatron range of it on every training rank (all DP/CP copies)."""
    out: dict[str, list[Holding]] = defaultdict(list)
    seen: set[tuple[str, Holding]] = set()
    for dp in range(mesh.dp):
        for cp in range(mesh.cp):
            if expert_domain(mesh, ep, dp, cp)[0] != (dp, cp):
                continue  # each expert domain once (with ep = 1 every replica is its own)
            for name, found in megatron_holdings(shape, mesh, dp, cp, use_tied_copy, ep).items():
                for holding in found:
                    if (name, holding) not in seen:
                        seen.add((name, holding))
                        out[name].append(holding)
    return out


class _LeastLoaded:
    """Chooses, for each range, the holder that has been given the fewest elements to send so far."""

    def __init__(self) -> None:
        self.load: dict[int, int] = defaultdict(int)

    def __call__(self, candidates: list[Holding], numel: int) -> Holding:
        best = min(candidates, key=lambda h: (self.load[h.rank], h.rank, h.held.chunk, h.held.mcore_name))
        self.load[best.rank] += numel
        return best


@dataclass(frozen=True)
class CrossPoolTotals:
    """Per member elements of one cross-pool sync (the same on every member: the plan is pure)."""

    sent: tuple[int, ...]  # by training member
    received: tuple[int, ...]  # by rollout member (index = rollout rank)
    needed: tuple[int, ...]  # by rollout member: its shard's real elements (padding excluded)

    @property
    def balanced_send_numel(self) -> int:
        """The heaviest sender's bound: everything received, spread evenly over the training ranks."""
        return ceil(sum(self.received) / max(len(self.sent), 1))


def cross_pool_pieces(shape: ModelShape, layout: CrossPoolLayout,
                      bucket_numel: int) -> tuple[list[list[Piece]], list[str]]:
    """Every piece of the sync in vLLM tensor order (then receiver), and the vLLM tensor names."""
    holdings = all_holdings(shape, layout.mesh, layout.ep, layout.use_tied_copy)
    targets_of = {j: vllm_targets(shape, layout.infer_tp, j) for j in range(layout.infer_tp)}
    names = list(targets_of[0])
    choose = _LeastLoaded()
    all_pieces: list[list[Piece]] = []
    receivers = [(layout.rollout_member(q), layout.rollout_tp_index(q)) for q in range(layout.rollout_world)]
    for name in names:
        pieces: list[Piece] = []
        for member, tp_index in receivers:
            target = targets_of[tp_index][name]
            for piece in match_target(target, member, holdings, choose):
                pieces.extend(split_piece(piece, bucket_numel))
        all_pieces.append(pieces)
    return all_pieces, names


def cross_pool_totals(shape: ModelShape, layout: CrossPoolLayout, bucket_numel: int = 1 << 62) -> CrossPoolTotals:
    pieces, _ = cross_pool_pieces(shape, layout, bucket_numel)
    sent: dict[int, int] = defaultdict(int)
    received: dict[int, int] = defaultdict(int)
    for per_tensor in pieces:
        for piece in per_tensor:
            sent[piece.src] += piece.numel
            received[piece.dst] += piece.numel
    needed = []
    for q in range(layout.rollout_world):
        targets = vllm_targets(shape, layout.infer_tp, layout.rollout_tp_index(q))
        needed.append(sum(t.numel - t.padding_numel for t in targets.values()))
    return CrossPoolTotals(
        sent=tuple(sent[r] for r in range(layout.trainer_world)),
        received=tuple(received[layout.rollout_member(q)] for q in range(layout.rollout_world)),
        needed=tuple(needed),
    )


def build_cross_pool_plan(shape: ModelShape, layout: CrossPoolLayout, member: int, *,
                          bucket_numel: int) -> RankReshardPlan:
    """The plan of cross-pool member `member` (a training rank sends, a rollout rank receives)."""
    if bucket_numel < 1:
        raise ValueError(f"bucket size must be positive, got {bucket_numel} elements")
    if not 0 <= member < layout.size:
        raise ValueError(f"member {member} outside the cross-pool group of {layout.size}")
    all_pieces, names = cross_pool_pieces(shape, layout, bucket_numel)
    buckets = bucketize(all_pieces, bucket_numel)
    gen_index = layout.gen_tp_index(member)
    receiving = gen_index is not None
    rank_buckets, peers, (recv, send, local) = rank_view(buckets, names if receiving else [], member)
    targets = vllm_targets(shape, layout.infer_tp, gen_index) if gen_index is not None else {}
    real = sum(t.numel - t.padding_numel for t in targets.values())
    if receiving:
        bound = real
    else:
        received = sum(p.numel for bucket in buckets for p in bucket)
        bound = ceil(received / layout.trainer_world)
    model_numel = sum(prod(dims) for dims in hf_tensor_shapes(shape).values())
    return RankReshardPlan(
        rank=member,
        gen_tp_index=gen_index if gen_index is not None else -1,
        infer_tp=layout.infer_tp,
        targets=targets,
        buckets=tuple(rank_buckets),
        micro_dp_group=(),
        peers=peers,
        recv_numel=recv,
        send_numel=send,
        local_numel=local,
        padding_numel=sum(t.padding_numel for t in targets.values()),
        lower_bound_numel=bound,
        # gather-everything (one rank collects the model and broadcasts it): every rollout rank takes it all
        naive_numel=model_numel if receiving else 0,
    )
