"""Who sends which rows of which megatron tensor to whom, so that each rank builds its vLLM shard.

Pure planning (no torch, no process groups): the same inputs give the same plan on every rank, so
the ranks agree on every message without exchanging metadata.

Both sides are described as ranges of HF tensors along one axis (`models.layout.Segment`):
- a vLLM tensor of generation TP rank j (`models.vllm_layout.vllm_targets`) is a concatenation of
  HF ranges (or zero padding), the layout `reshard.layout.hf_to_vllm_shards` materializes;
- a megatron tensor of a (tp, pp, vpp) rank (`models.layout.shard_ranges`) likewise.
Both come from the family's one weight table (`hybridrl/models/families/`).
Intersecting them tells, for every range a rank needs, which ranks hold it. A rank takes a range from
itself when it can, else from a holder inside its micro-DP group (`ReshardGroups`), else from any
holder of its own DP/CP replica (each replica reshards independently, so traffic never crosses them).
With the Plan's groups every needed range is found inside the micro-DP group: the rank receives
exactly |generation shard| - |generation shard ∩ own training shard| (HybridFlow §5).

The transfers are cut into buckets: consecutive pieces (in vLLM tensor order) such that on every rank
the bytes it sends plus the bytes it receives within one bucket stay under `bucket_bytes` (a piece
larger than that is split along its axis). Megatron's tied-embedding copy on the last stage counts as
held there (it is kept bit-equal to the first stage's by megatron's embedding-group all-reduce).

Mixture of experts with expert parallelism `ep` and expert TP `etp`: megatron's expert mesh puts EP
rank (i // etp) % ep and expert TP rank i % etp on local rank i of a stage (with ETP = TP a whole
DP/CP replica shares its EP rank, (cp + CP * dp) mod ep, `expert_rank_of`), so a rank holds its EP
rank's experts, each cut to its expert TP rank's part, while vLLM (TP over each expert's width) needs
every expert on every rank. The unit that resharding stays inside is then the consecutive replicas
that hold every tensor between them: a stage's rank files repeat every `ParallelLayout.slots` local
ranks, i.e. every slots / tp replicas (`expert_domain`; `ep` replicas with ETP = TP). The plan covers
all ranks of that domain, and a rank takes each range from itself, else its micro-DP group, else the
domain's rank that holds it.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from math import prod

from hybridrl.config.meshes import ReshardGroups, TrainingMesh
from hybridrl.models.arch import ModelShape
from hybridrl.models.layout import ModelRank, ShardRange, TensorPlan, hf_tensor_shapes, shard_ranges
from hybridrl.models.vllm_layout import vllm_targets


@dataclass(frozen=True)
class Holding:
    """A megatron range of an HF tensor (`ShardRange`) on global rank `rank` of one DP/CP replica."""

    rank: int
    held: ShardRange


@dataclass(frozen=True)
class Piece:
    """`length` positions along `axis` copied from a megatron tensor of `src` into a vLLM tensor of `dst`."""

    target: str
    dst: int
    dst_offset: int
    src: int
    chunk: int
    mcore_name: str
    src_offset: int
    length: int
    axis: int | None
    shape: tuple[int, ...]  # shape of the piece itself

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class RankBucket:
    """What one rank does in one bucket. Pieces are listed in the order both ends pack them."""

    sends: dict[int, tuple[Piece, ...]]  # destination rank -> pieces
    recvs: dict[int, tuple[Piece, ...]]  # source rank -> pieces
    local: tuple[Piece, ...]
    opens: tuple[str, ...]  # vLLM tensors first written in this bucket (allocated here)
    completes: tuple[str, ...]  # vLLM tensors whose last piece lands here (yielded after it)

    @property
    def transient_numel(self) -> int:
        return sum(p.numel for ps in (*self.sends.values(), *self.recvs.values()) for p in ps)


@dataclass(frozen=True)
class RankReshardPlan:
    rank: int
    gen_tp_index: int
    infer_tp: int
    targets: dict[str, TensorPlan]
    buckets: tuple[RankBucket, ...]
    micro_dp_group: tuple[int, ...]
    peers: tuple[int, ...]  # ranks this rank sends to or receives from
    recv_numel: int
    send_numel: int
    local_numel: int
    padding_numel: int  # zero rows of vLLM's vocab padding: written, never moved
    # the elements of its generation shard this rank does not hold (vocab padding and KV layout included):
    # the least any plan can make it receive for that shard
    lower_bound_numel: int
    naive_numel: int  # gather-everything: the whole model minus what this rank holds
    extra: dict[str, int] = field(default_factory=dict)

    @property
    def target_numel(self) -> int:
        return sum(t.numel for t in self.targets.values())

    @property
    def peers_outside_micro_dp(self) -> tuple[int, ...]:
        return tuple(p for p in self.peers if p not in self.micro_dp_group)


# ---- the megatron side -----------------------------------------------------------------------------

def expert_rank_of(mesh: TrainingMesh, ep: int, dp: int, cp: int) -> int:
    """The EP rank of DP/CP replica (dp, cp) with ETP = TP: megatron's expert mesh (etp-ep-edp-pp)
    numbers the ranks of one TP × PP position by cp + CP * dp, EP fastest."""
    return (cp + mesh.cp * dp) % ep


def model_rank_of(mesh: TrainingMesh, rank: int, ep: int = 1, etp: int | None = None) -> ModelRank:
    """The rank file position (`layout.ModelRank`: TP, PP, EP and expert TP rank) whose tensors global
    `rank` holds: its stage's slot (`ParallelLayout.slot_ranks` of its local rank)."""
    tp_rank, ep_rank, etp_rank = mesh.layout(ep, etp).slot_ranks(mesh.local_rank(rank))
    return ModelRank(tp_rank, mesh.coord(rank).pp, ep_rank, etp_rank)


def expert_domain(mesh: TrainingMesh, ep: int, dp: int, cp: int, etp: int | None = None) -> list[tuple[int, int]]:
    """The (dp, cp) replicas that hold every tensor between them, (dp, cp)'s included: the slots / tp
    consecutive replicas of its block (with ETP = TP, ep of them; with ep = 1 as well, the replica itself)."""
    layout = mesh.layout(ep, etp)
    stage = mesh.world_size // mesh.pp
    if ep < 1 or stage % (ep * layout.expert_tp):
        raise ValueError(f"ep={ep} does not divide dp*cp = {mesh.dp}*{mesh.cp}" if etp in (None, mesh.tp) else
                         f"ep*etp = {ep}*{etp} does not divide a stage's tp*cp*dp = {stage} ranks")
    size = layout.slots // mesh.tp
    block = (cp + mesh.cp * dp) // size
    return [(index // mesh.cp, index % mesh.cp) for index in range(block * size, (block + 1) * size)]


def megatron_holdings(
    shape: ModelShape, mesh: TrainingMesh, dp: int, cp: int, use_tied_copy: bool = True, ep: int = 1,
    etp: int | None = None,
) -> dict[str, list[Holding]]:
    """HF name -> every megatron range of it held by the ranks of (dp, cp)'s expert domain (its
    DP/CP replica when ep = 1 and ETP = TP), copies included."""
    tied_output = shape.weights.lm_head.megatron
    by_rank: dict[ModelRank, list[ShardRange]] = defaultdict(list)
    for found in shard_ranges(shape, mesh.layout(ep, etp)).values():
        for held in found:
            if not (held.mcore_name == tied_output and held.is_copy and not use_tied_copy):
                by_rank[held.rank].append(held)
    out: dict[str, list[Holding]] = defaultdict(list)
    for replica_dp, replica_cp in expert_domain(mesh, ep, dp, cp, etp):
        for pp in range(mesh.pp):
            for tp in range(mesh.tp):
                rank = mesh.rank_of(tp=tp, cp=replica_cp, dp=replica_dp, pp=pp)
                for held in by_rank[model_rank_of(mesh, rank, ep, etp)]:
                    out[held.hf_name].append(Holding(rank, held))
    return out


# ---- matching ----------------------------------------------------------------------------------------

def _piece_shape(target: TensorPlan, length: int) -> tuple[int, ...]:
    if target.axis is None:
        return target.shape
    dims = list(target.shape)
    dims[target.axis] = length
    return tuple(dims)


def _choose(candidates: list[Holding], dst: int, micro_group: frozenset[int]) -> Holding:
    """Self first, then a holder in the micro-DP group, then any; ties spread by the receiver's rank."""
    own = [h for h in candidates if h.rank == dst]
    if own:
        return own[0]
    near = [h for h in candidates if h.rank in micro_group] or candidates
    near.sort(key=lambda h: (h.rank, h.held.chunk, h.held.mcore_name))
    return near[dst % len(near)]


Chooser = Callable[[list[Holding], int], Holding]  # (holders of a range, its elements) -> the sender


def colocated_chooser(dst: int, micro_group: frozenset[int]) -> Chooser:
    """The hybrid engine's rule for receiver `dst`: itself, then its micro-DP group (`_choose`)."""
    return lambda candidates, _numel: _choose(candidates, dst, micro_group)


def match_target(
    target: TensorPlan, dst: int, holdings: dict[str, list[Holding]], choose: Chooser
) -> list[Piece]:
    """Pieces that fill `target` on rank `dst` (padding excluded: it stays zero); `choose` picks the
    sender of each range among the ranks holding it."""
    pieces: list[Piece] = []
    dst_offset = 0
    for seg in target.segments:
        if seg.hf_name is None:
            dst_offset += seg.length
            continue
        found = holdings.get(seg.hf_name, [])
        if target.axis is None:
            whole = [h for h in found if h.held.axis is None]
            if not whole:
                raise ValueError(f"no rank of this replica holds {seg.hf_name}")
            h = choose(whole, target.numel)
            pieces.append(Piece(target.name, dst, 0, h.rank, h.held.chunk, h.held.mcore_name, 0, seg.length, None,
                                target.shape))
            dst_offset += seg.length
            continue
        # Elementary intervals between every holder boundary inside the wanted range.
        cuts = {seg.start, seg.stop}
        for h in found:
            for point in (h.held.hf_start, h.held.hf_stop):
                if seg.start < point < seg.stop:
                    cuts.add(point)
        points = sorted(cuts)
        for lo, hi in zip(points, points[1:]):
            covering = [h for h in found if h.held.hf_start <= lo and hi <= h.held.hf_stop]
            if not covering:
                raise ValueError(f"no rank of this replica holds {seg.hf_name}[{lo}:{hi}]")
            h = choose(covering, (hi - lo) * (target.numel // target.shape[target.axis]))
            src_offset = h.held.shard_offset + lo - h.held.hf_start
            at = dst_offset + lo - seg.start
            last = pieces[-1] if pieces else None
            if (last is not None and last.src == h.rank and last.mcore_name == h.held.mcore_name
                    and last.chunk == h.held.chunk and last.src_offset + last.length == src_offset
                    and last.dst_offset + last.length == at):
                length = last.length + hi - lo
                pieces[-1] = Piece(target.name, dst, last.dst_offset, h.rank, h.held.chunk, h.held.mcore_name,
                                   last.src_offset, length, target.axis, _piece_shape(target, length))
            else:
                pieces.append(Piece(target.name, dst, at, h.rank, h.held.chunk, h.held.mcore_name, src_offset, hi - lo,
                                    target.axis, _piece_shape(target, hi - lo)))
        dst_offset += seg.length
    return pieces


def split_piece(piece: Piece, max_numel: int) -> list[Piece]:
    """Cut a piece along its axis so each part has at most `max_numel` elements (at least one row)."""
    if piece.axis is None or piece.numel <= max_numel:
        return [piece]
    per_position = piece.numel // piece.length
    step = max(1, max_numel // per_position)
    out = []
    for start in range(0, piece.length, step):
        length = min(step, piece.length - start)
        dims = list(piece.shape)
        dims[piece.axis] = length
        out.append(Piece(piece.target, piece.dst, piece.dst_offset + start, piece.src, piece.chunk,
                         piece.mcore_name, piece.src_offset + start, length, piece.axis, tuple(dims)))
    return out


def _overlap_numel(target: TensorPlan, own: dict[str, list[Holding]]) -> int:
    """Elements of `target` a rank holding `own` already has."""
    total = 0
    per_position = target.numel // (target.shape[target.axis] if target.axis is not None else target.numel)
    for seg in target.segments:
        if seg.hf_name is None:
            continue
        ranges = sorted((h.held.hf_start, h.held.hf_stop) for h in own.get(seg.hf_name, ())
                        if (h.held.axis is None) == (target.axis is None))
        covered, cursor = 0, seg.start
        for lo, hi in ranges:
            lo, hi = max(lo, cursor), min(hi, seg.stop)
            if hi > lo:
                covered += hi - lo
                cursor = hi
        total += covered * (per_position if target.axis is not None else 1)
    return total


def _need_numel(targets: Iterable[TensorPlan], own: dict[str, list[Holding]]) -> int:
    """Elements of `targets` (a generation shard) that a rank holding `own` lacks, vocab padding aside."""
    return sum(t.numel - _overlap_numel(t, own) - t.padding_numel for t in targets)


def _held_hf_numel(shape: ModelShape, own: dict[str, list[Holding]]) -> int:
    """HF elements (each counted once) a rank holds: what a gather-everything design need not receive."""
    hf_shapes = hf_tensor_shapes(shape)
    total = 0
    for name, found in own.items():
        per_position = prod(hf_shapes[name]) // hf_shapes[name][found[0].held.axis or 0] if found else 0
        ranges = sorted({(h.held.hf_start, h.held.hf_stop) for h in found})
        cursor = 0
        for lo, hi in ranges:
            lo = max(lo, cursor)
            if hi > lo:
                total += (hi - lo) * (per_position if found[0].held.axis is not None else 1)
                cursor = hi
    return total


def build_rank_plan(
    shape: ModelShape,
    mesh: TrainingMesh,
    groups: ReshardGroups,
    rank: int,
    *,
    bucket_numel: int,
    gen_tp_index: tuple[int, ...] | None = None,
    use_tied_copy: bool = True,
    ep: int = 1,
    etp: int | None = None,
) -> RankReshardPlan:
    """The plan of `rank`: its buckets, computed from the whole plan of its DP/CP replica (of its
    expert domain with ep > 1 or an expert TP other than TP: see the module docstring).

    `gen_tp_index` overrides the groups' generation TP rank per global rank (e.g. vLLM's default
    consecutive TP groups, rank % infer_tp) — the plan stays correct, only the traffic grows.
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket size must be positive, got {bucket_numel} elements")
    infer_tp = groups.rollout.infer_tp
    gen_index = tuple(gen_tp_index) if gen_tp_index is not None else groups.gen_tp_index
    if len(gen_index) != mesh.world_size:
        raise ValueError(f"gen_tp_index has {len(gen_index)} entries for {mesh.world_size} ranks")
    coord = mesh.coord(rank)
    replica_ranks = [mesh.rank_of(tp=t, cp=c, dp=d, pp=p)
                     for d, c in expert_domain(mesh, ep, coord.dp, coord.cp, etp)
                     for p in range(mesh.pp) for t in range(mesh.tp)]
    replica_ranks.sort()
    holdings = megatron_holdings(shape, mesh, coord.dp, coord.cp, use_tied_copy, ep, etp)
    micro_of = {}
    for group in groups.micro_dp_groups:
        for member in group:
            micro_of[member] = frozenset(group)

    # Every piece of the replica, in vLLM tensor order (then receiver, then position).
    targets_of = {r: vllm_targets(shape, infer_tp, gen_index[r]) for r in replica_ranks}
    names = list(targets_of[rank])
    all_pieces: list[list[Piece]] = []  # per vLLM tensor name
    for name in names:
        pieces: list[Piece] = []
        for r in replica_ranks:
            choose = colocated_chooser(r, micro_of.get(r, frozenset({r})))
            for piece in match_target(targets_of[r][name], r, holdings, choose):
                pieces.extend(split_piece(piece, bucket_numel) if piece.src != piece.dst else [piece])
        all_pieces.append(pieces)

    buckets = bucketize(all_pieces, bucket_numel)
    rank_buckets, peers, (recv, send, local) = rank_view(buckets, names, rank)

    targets = targets_of[rank]
    padding = sum(t.padding_numel for t in targets.values())
    own = {n: [h for h in hs if h.rank == rank] for n, hs in holdings.items()}
    bound = _need_numel(targets.values(), own)
    model_numel = sum(prod(dims) for dims in hf_tensor_shapes(shape).values())
    return RankReshardPlan(
        rank=rank,
        gen_tp_index=gen_index[rank],
        infer_tp=infer_tp,
        targets=targets,
        buckets=tuple(rank_buckets),
        micro_dp_group=tuple(sorted(micro_of.get(rank, frozenset({rank})))),
        peers=peers,
        recv_numel=recv,
        send_numel=send,
        local_numel=local,
        padding_numel=padding,
        lower_bound_numel=bound,
        naive_numel=model_numel - _held_hf_numel(shape, own),
    )


def bucketize(all_pieces: Sequence[Sequence[Piece]], bucket_numel: int) -> list[list[Piece]]:
    """Greedy buckets over every rank's pieces in order: a bucket closes before any rank's sent +
    received elements in it would exceed `bucket_numel` (local copies cost no budget)."""
    buckets: list[list[Piece]] = [[]]
    load: dict[int, int] = defaultdict(int)
    for pieces in all_pieces:
        for piece in pieces:
            if piece.src != piece.dst:
                if buckets[-1] and (load[piece.src] + piece.numel > bucket_numel
                                    or load[piece.dst] + piece.numel > bucket_numel):
                    buckets.append([])
                    load.clear()
                load[piece.src] += piece.numel
                load[piece.dst] += piece.numel
            buckets[-1].append(piece)
    return buckets


def rank_view(buckets: Sequence[Sequence[Piece]], names: Sequence[str],
              rank: int) -> tuple[list[RankBucket], tuple[int, ...], tuple[int, int, int]]:
    """`rank`'s part of the buckets (`names`: the tensors it produces, in order): its buckets, its
    peers, and the (received, sent, local) elements."""
    first_touch: dict[str, int] = {}
    last_touch: dict[str, int] = {}
    for index, bucket in enumerate(buckets):
        for piece in bucket:
            if piece.dst == rank:
                first_touch.setdefault(piece.target, index)
                last_touch[piece.target] = index
    for name in names:  # a tensor made only of padding still has to be produced
        first_touch.setdefault(name, 0)
        last_touch.setdefault(name, 0)

    rank_buckets = []
    peers: set[int] = set()
    recv = send = local = 0
    for index, bucket in enumerate(buckets):
        sends: dict[int, list[Piece]] = defaultdict(list)
        recvs: dict[int, list[Piece]] = defaultdict(list)
        locals_ = []
        for piece in bucket:
            if piece.src == rank and piece.dst == rank:
                locals_.append(piece)
                local += piece.numel
            elif piece.src == rank:
                sends[piece.dst].append(piece)
                send += piece.numel
                peers.add(piece.dst)
            elif piece.dst == rank:
                recvs[piece.src].append(piece)
                recv += piece.numel
                peers.add(piece.src)
        rank_buckets.append(RankBucket(
            sends={d: tuple(ps) for d, ps in sorted(sends.items())},
            recvs={s: tuple(ps) for s, ps in sorted(recvs.items())},
            local=tuple(locals_),
            opens=tuple(n for n in names if first_touch[n] == index),
            completes=tuple(n for n in names if last_touch[n] == index),
        ))
    return rank_buckets, tuple(sorted(peers)), (recv, send, local)
