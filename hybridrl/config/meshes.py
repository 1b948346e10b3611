"""Which global ranks form each parallel group: training meshes, rollout mesh, resharding groups.

Pure integer math, shared by the planner (to show and check it) and by the runtime (to build
process groups and the resharder), so what `hybridrl plan` prints is what runs. Where the layers
sit is `hybridrl.models.layout`'s rule, through `TrainingMesh.layout`.

Training ranks follow megatron-core's default order "tp-cp-ep-dp-pp" (tp varies fastest, pp
slowest; expert parallelism has a mesh of its own, `expert_groups`):  rank = tp + TP*(cp + CP*(dp + DP*pp)).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import product

from hybridrl.models.layout import ParallelLayout

Groups = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class RankCoord:
    """One training rank's position in the mesh."""

    rank: int
    tp: int
    cp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class TrainingMesh:
    tp: int
    pp: int
    cp: int
    dp: int
    vpp: int | None
    tp_groups: Groups
    pp_groups: Groups
    dp_groups: Groups
    cp_groups: Groups
    # megatron's num_layers_in_first/last_pipeline_stage (None: even split)
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __hash__(self) -> int:
        # the groups follow from the sizes: hashing those alone keeps a 1,024-rank mesh a cheap cache key
        return hash((self.tp, self.pp, self.cp, self.dp, self.vpp, self.first_stage_layers, self.last_stage_layers))

    def layout(self, ep: int = 1, etp: int | None = None) -> ParallelLayout:
        """The model layout on this mesh: where every layer and tensor sits (`hybridrl.models.layout`);
        `ep`, `etp` (None: TP) place an MoE model's experts."""
        return ParallelLayout(tp=self.tp, pp=self.pp, vpp=self.vpp, ep=ep,
                              first_stage_layers=self.first_stage_layers, last_stage_layers=self.last_stage_layers,
                              etp=etp)

    def local_rank(self, rank: int) -> int:
        """`rank`'s index inside its pipeline stage (pp is the slowest axis): megatron's expert mesh
        places expert TP and EP ranks by it (`ParallelLayout.slot_ranks`)."""
        return rank % (self.world_size // self.pp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def coord(self, rank: int) -> RankCoord:
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        return RankCoord(rank, tp_rank, cp_rank, dp_rank, pp_rank)

    def rank_of(self, *, tp: int, cp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def output_ranks(self) -> tuple[int, ...]:
        """Ranks that own a DP chunk's output: last pipeline stage, TP rank 0, CP rank 0; by dp."""
        return tuple(self.rank_of(tp=0, cp=0, dp=d, pp=self.pp - 1) for d in range(self.dp))


# cached: `hybridrl plan --search` plans hundreds of layouts that share a few dozen meshes (a mesh is immutable)
@functools.lru_cache(maxsize=256)
def build_training_mesh(world_size: int, tp: int, pp: int, cp: int = 1, vpp: int | None = None, *,
                        first_stage_layers: int | None = None,
                        last_stage_layers: int | None = None) -> TrainingMesh:
    model_size = tp * pp * cp
    if model_size <= 0 or world_size % model_size:
        raise ValueError(f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}")
    dp = world_size // model_size
    mesh = TrainingMesh(tp, pp, cp, dp, vpp, (), (), (), ())

    def groups(vary: str) -> Groups:
        sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
        fixed = [axis for axis in ("tp", "cp", "dp", "pp") if axis != vary]
        out = []
        for values in product(*(range(sizes[a]) for a in reversed(fixed))):
            base = dict(zip(reversed(fixed), values))
            out.append(tuple(mesh.rank_of(**{**base, vary: i}) for i in range(sizes[vary])))
        return tuple(sorted(out))

    return TrainingMesh(tp, pp, cp, dp, vpp, groups("tp"), groups("pp"), groups("dp"), groups("cp"),
                        first_stage_layers, last_stage_layers)


def expert_groups(mesh: TrainingMesh, ep: int, etp: int | None = None) -> tuple[Groups, Groups]:
    """(EP groups, expert-data-parallel groups) of an MoE model's experts on `mesh`: megatron's expert
    rank generator orders the same ranks etp-ep-edp-pp (no CP axis; `etp` None: TP), so
    rank = x + ETP*(ep_rank + EP*(expert_dp + EDP*pp)) for expert TP rank x, with
    EDP = TP*CP*DP / (ETP*EP). An EP group splits a layer's experts between its ranks; an expert-DP
    group holds copies of the same experts."""
    etp = mesh.tp if etp is None else etp
    stage = mesh.world_size // mesh.pp
    if ep < 1 or etp < 1 or stage % (ep * etp):
        raise ValueError(f"ep={ep} does not divide dp*cp = {mesh.dp}*{mesh.cp}" if etp == mesh.tp else
                         f"ep*etp = {ep}*{etp} does not divide a stage's tp*cp*dp = {stage} ranks")
    edp = stage // (ep * etp)

    def rank(x: int, e: int, d: int, p: int) -> int:
        return x + etp * (e + ep * (d + edp * p))

    ep_groups = tuple(sorted(tuple(rank(x, e, d, p) for e in range(ep))
                             for x, d, p in product(range(etp), range(edp), range(mesh.pp))))
    edp_groups = tuple(sorted(tuple(rank(x, e, d, p) for d in range(edp))
                              for x, e, p in product(range(etp), range(ep), range(mesh.pp))))
    return ep_groups, edp_groups


def expert_group_spans_replicas(tp: int, cp: int, ep: int, etp: int | None = None) -> bool:
    """Whether megatron's expert TP x EP group (the `etp * ep` consecutive ranks of a pipeline stage
    in its expert rank generator's order) holds ranks of different DP replicas (each `tp * cp`
    consecutive ranks), which feed it micro-batches of their own rows. `etp` None: TP."""
    return (tp * cp) % ((etp or tp) * ep) != 0


@dataclass(frozen=True)
class RolloutMesh:
    """vLLM replicas: `replicas[i]` are the ranks of replica i in vLLM TP-rank order."""

    infer_tp: int
    infer_dp: int
    replicas: Groups


@dataclass(frozen=True)
class ReshardGroups:
    """HybridFlow §5 grouping between a training mesh and the rollout mesh.

    `micro_dp_groups[k]` all need the same generation shard and together hold it (zero redundancy),
    so one all-gather inside each of them is all the TP/PP resharding needs. `gen_tp_index[rank]`
    is the rank's TP rank inside its vLLM replica.
    """

    rollout: RolloutMesh
    micro_dp_size: int
    micro_dp_groups: Groups
    gen_tp_index: tuple[int, ...]
    strategy: str


def build_reshard_groups(mesh: TrainingMesh, infer_tp: int) -> ReshardGroups:
    """Generation TP groups chosen so each rank's generation shard contains its training shard.

    When the training TP is a multiple of the inference TP (t = k * t_g), a training TP group of t
    ranks hosts k vLLM replicas: replica c takes the ranks at stride k (tp ranks c, c+k, ...), so
    generation TP rank j lands on training tp rank j*k + c, whose shard lies inside generation shard
    j. The ranks that share j — k consecutive TP ranks on every pipeline stage — form a micro-DP
    group of size k*pp; gathering inside it builds shard j from pieces nobody else needs.

    When the inference TP is a multiple of the training TP (t_g = m * t, t == 1 included), each
    training shard splits into m generation shards: generation TP rank j should sit on a rank of
    training tp rank j // m, so a replica takes m ranks of every training tp rank (ranks that differ
    in pp, dp or cp). Each rank then holds generation shard j of its own stage's layers and needs the
    other stages' from the ranks of its pipeline group with the same tp rank. vLLM orders a replica's
    ranks by global rank, tp fastest: at t == 1 that is the order wanted; at t > 1 the training tp
    ranks interleave and a generation rank may hold none of its shard (correct, more traffic, planned).
    (Plain consecutive replicas would put generation rank 1 on training tp rank 1 for t=2, t_g=4,
    whose shard lies in generation shards 2-3: it would receive its whole shard.)

    Otherwise (neither divides the other) each replica is a block of consecutive ranks.
    """
    world = mesh.world_size
    if infer_tp <= 0 or world % infer_tp:
        raise ValueError(f"inference TP {infer_tp} does not divide the world size {world}")
    if mesh.tp % infer_tp == 0 and mesh.tp > 1:
        stride = mesh.tp // infer_tp
        replicas = [tuple(tp_group[j * stride + c] for j in range(infer_tp))
                    for tp_group in mesh.tp_groups for c in range(stride)]
        micro_groups = [
            tuple(sorted(mesh.rank_of(tp=j * stride + c, cp=cp, dp=dp, pp=pp)
                         for pp in range(mesh.pp) for c in range(stride)))
            for dp, cp in product(range(mesh.dp), range(mesh.cp)) for j in range(infer_tp)
        ]
        strategy, micro_dp = "strided", stride * mesh.pp
    else:
        if infer_tp % mesh.tp == 0:
            split = infer_tp // mesh.tp
            by_tp_rank = [[r for r in range(world) if mesh.coord(r).tp == t] for t in range(mesh.tp)]
            replicas = [tuple(by_tp_rank[t][k * split + i] for t in range(mesh.tp) for i in range(split))
                        for k in range(world // infer_tp)]
            strategy = "split"
        else:
            replicas = [tuple(range(start, start + infer_tp)) for start in range(0, world, infer_tp)]
            strategy = "consecutive"
        # Each rank holds generation shards of its own stage's layers; the other stages' layers
        # come from the ranks of its pipeline group (same tp, cp, dp).
        micro_groups = [tuple(sorted(mesh.rank_of(tp=tp, cp=cp, dp=dp, pp=pp) for pp in range(mesh.pp)))
                        for dp, cp in product(range(mesh.dp), range(mesh.cp)) for tp in range(mesh.tp)]
        micro_dp = mesh.pp
    # vLLM numbers a TP group's ranks in ascending global rank (torch's new_group sorts them; vLLM's gathers
    # follow that order), so a replica's generation TP rank j is its j-th smallest rank whatever order the
    # strategy listed: with training TP > 1 the split strategy's tp-major order interleaves and some generation
    # ranks land off their training tp rank (the plan counts the traffic of the order vLLM builds)
    replicas = sorted(tuple(sorted(replica)) for replica in replicas)
    gen_index = [0] * world
    for replica in replicas:
        for j, rank in enumerate(replica):
            gen_index[rank] = j
    rollout = RolloutMesh(infer_tp, world // infer_tp, tuple(replicas))
    return ReshardGroups(rollout, micro_dp, tuple(sorted(micro_groups)), tuple(gen_index), strategy)


def build_pool_groups(rollout_world: int, infer_tp: int) -> ReshardGroups:
    """A disaggregated rollout pool's replicas: blocks of consecutive ranks of the pool (vLLM's own TP
    groups), numbered within the pool. No micro-DP groups: the pool holds no training shard, so each
    rank receives its whole generation shard from the trainer pool (`reshard.cross_pool_plan`)."""
    if infer_tp <= 0 or rollout_world % infer_tp:
        raise ValueError(f"inference TP {infer_tp} does not divide the rollout pool's {rollout_world} ranks")
    replicas = tuple(tuple(range(start, start + infer_tp)) for start in range(0, rollout_world, infer_tp))
    rollout = RolloutMesh(infer_tp, rollout_world // infer_tp, replicas)
    return ReshardGroups(rollout, 0, (), tuple(r % infer_tp for r in range(rollout_world)), "cross_pool")


def interval_overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def adapter_sender(rollout_rank: int, trainer_world: int) -> int:
    """A disaggregated sync of served LoRA adapters (`reshard.adapter_sync`): the training rank (= its cross-pool
    member) that ships the whole adapter to `rollout_rank`, so that the sends spread over the trainer pool."""
    return rollout_rank % trainer_world


def adapter_receivers(trainer_rank: int, trainer_world: int, rollout_world: int) -> list[int]:
    """The rollout ranks training rank `trainer_rank` ships the adapter to (those whose `adapter_sender` it is)."""
    return [q for q in range(rollout_world) if adapter_sender(q, trainer_world) == trainer_rank]
