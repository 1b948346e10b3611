"""The distributed resharder: megatron training shards -> this rank's vLLM generation shard.

At sync time every actor rank (all TP/PP/DP/CP ranks, at the same time) does:

    resharder = Resharder(models, plan.reshard.groups)        # once; models from build_gpt_models
    check_rollout_placement(resharder, rollout.tp_rank)        # once: vLLM's TP rank is the one we build
    ...
    rollout.update_weights(resharder.shards(), weight_format="vllm_shard")   # each sync
    report = resharder.last_report                             # SyncReport: bytes, time, memory, checksums
    verify_checksums(report.checksums, rollout.parameter_digests(), rank)    # raises ShardChecksumError

`shards()` yields `(vLLM name, tensor)` for exactly `hf_to_vllm_shards(full HF state, config,
infer_tp, gen_tp_index[rank])`, tensor by tensor as they complete, without ever holding the full model:
- what it moves follows `engine.reshard_plan` (pure, identical on every rank): each needed range
  comes from the rank itself, else from its micro-DP group; DP/CP replicas reshard independently;
- movement is point-to-point (`batch_isend_irecv`, gloo on CPU, nccl on GPU), one message per
  (sender, receiver) pair and bucket, so across pipeline stages a layer goes only to the ranks that
  need it and inside a micro-DP group each piece goes only to the members that lack it;
- buckets bound the transient memory: within one bucket a rank's packed sends plus receive
  buffers stay under `bucket_bytes`; the rest is the shard being produced (tensors are handed to
  the consumer as soon as they complete, so a consumer that writes and drops them keeps even
  that small).

It is a collective generator: every rank of the DP/CP replica must run it to the end. The rollout
engine's lifecycle is not ours: we only produce tensors (and their checksums).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.config.estimates import ReshardTraffic, reshard_traffic
from hybridrl.config.meshes import ReshardGroups, TrainingMesh, build_training_mesh
from hybridrl.models.bridge import chunk_info, chunk_tensors, unwrap_model
from hybridrl.models.lora import merged_weights
from hybridrl.parallel.state import get_context
from hybridrl.reshard.exchange import ExchangeStats, ScratchBuffers, WorldTransport, exchange
from hybridrl.reshard.reshard_plan import RankReshardPlan, build_rank_plan, model_rank_of

DEFAULT_BUCKET_BYTES = 512 * 1024**2
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class ReshardConfig:
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    # Use megatron's copy of a tied embedding on the last stage instead of receiving it (bit-equal:
    # megatron all-reduces the two copies' gradients over the embedding group).
    use_tied_copy: bool = True
    checksums: bool = True
    # dtype of the transfer and of the produced shards (vLLM's model dtype); None: megatron's params_dtype
    output_dtype: torch.dtype | None = None
    # Keep the largest bucket's send/receive buffers between syncs (`exchange.ScratchBuffers`); the
    # workers take it from `DevicePolicy.reshard_keeps_buffers`.
    keep_buffers: bool = False
    # A LoRA actor's adapters merged into the weights it sends (lora.merge true); false: the base weights
    # alone (vLLM serves the adapters itself, `reshard.adapter_sync`)
    merge_adapters: bool = True


@dataclass(frozen=True)
class SyncReport:
    """One rank's account of one weight sync. Byte counts are measured in the send/recv code."""

    rank: int
    gen_tp_index: int
    infer_tp: int
    strategy: str
    bytes_sent: int
    bytes_received: int
    messages_sent: int
    messages_received: int
    buckets: int
    seconds: float  # time spent inside the resharder (consumer time between yields excluded)
    checksum_seconds: float  # part of `seconds` spent digesting the produced tensors
    wait_seconds: float  # part of `seconds` blocked on transfers (peers not ready, or the wire)
    wall_seconds: float  # first tensor requested -> last tensor handed over
    peak_buffer_bytes: int  # largest set of live send/receive buffers
    peak_extra_bytes: int  # buffers + shard tensors allocated and not yet handed over
    generation_shard_bytes: int
    planned_bytes_received: int  # from the pure plan (exact: padding and KV layout included)
    # the bytes of this rank's generation shard it does not hold (vocab padding and the KV layout included):
    # the least any plan can move to it for that shard
    exact_lower_bound_bytes: int
    plan_bytes_received: int | None  # the Plan's estimate (`config.estimates.reshard_traffic`)
    plan_lower_bound_bytes: int | None  # HybridFlow Table 2 bound, as the Plan computes it
    naive_gather_bytes: int  # gather-everything: the whole model minus what this rank holds
    peers: tuple[int, ...]
    peers_outside_micro_dp: tuple[int, ...]
    checksums: dict[str, str] = field(default_factory=dict)

    @property
    def ratio_to_lower_bound(self) -> float:
        bound = self.plan_lower_bound_bytes if self.plan_lower_bound_bytes is not None else self.exact_lower_bound_bytes
        if bound == 0:
            return 1.0 if self.bytes_received == 0 else float("inf")
        return self.bytes_received / bound

    def as_metrics(self, prefix: str = "reshard/") -> dict[str, float]:
        """Scalar metrics for the tracker (checksums and peer lists left out)."""
        skip = {"checksums", "peers", "peers_outside_micro_dp", "strategy"}
        out = {prefix + k: float(v) for k, v in asdict(self).items() if k not in skip and v is not None}
        out[prefix + "ratio_to_lower_bound"] = self.ratio_to_lower_bound
        return out


class Resharder:
    """Produces this rank's vLLM shard from its megatron model chunks; see the module docstring.

    `models`: this rank's GPTModel chunks (one per VPP stage) as built by `build_gpt_models`
    (megatron DDP wrappers are fine). `groups`: the Plan's `ReshardGroups` for the actor mesh.
    `gen_tp_index`: override of the generation TP rank of each global rank (default: the groups').
    """

    def __init__(
        self,
        models: Sequence[Any],
        groups: ReshardGroups,
        *,
        mesh: TrainingMesh | None = None,
        config: ReshardConfig | None = None,
        gen_tp_index: Sequence[int] | None = None,
        ctx: Any = None,
    ) -> None:
        if ctx is None:
            ctx = get_context()
        self.config = config or ReshardConfig()
        self._scratch = ScratchBuffers() if self.config.keep_buffers else None
        self.groups = groups
        self.rank = dist.get_rank()
        self.mesh = mesh or build_training_mesh(
            ctx.world_size, ctx.tp, ctx.pp, ctx.cp, ctx.vpp,
            first_stage_layers=getattr(ctx, "first_stage_layers", None),
            last_stage_layers=getattr(ctx, "last_stage_layers", None))
        coord = self.mesh.coord(self.rank)
        if (coord.tp, coord.pp, coord.dp, coord.cp) != (ctx.tp_rank, ctx.pp_rank, ctx.dp_rank, ctx.cp_rank):
            raise ValueError(f"rank {self.rank}: mesh says {coord}, megatron says tp {ctx.tp_rank} pp "
                             f"{ctx.pp_rank} dp {ctx.dp_rank} cp {ctx.cp_rank} (rank order must be tp-cp-dp-pp)")
        sources = training_sources(models, self.mesh, self.rank, merge_adapters=self.config.merge_adapters)
        self.shape, self._tensors, self.device = sources.shape, sources.tensors, sources.device
        # One transfer dtype, known alike on every rank (the plan's bucket sizes depend on it): the
        # requested output dtype, else megatron's params_dtype. Tensors kept in another dtype (the
        # CPU torch norms stay fp32 in a bf16 model) are cast while packing, as vLLM holds them all
        # in its model dtype.
        self.dtype: torch.dtype = self.config.output_dtype or sources.params_dtype
        element = torch.empty((), dtype=self.dtype).element_size()
        self.ep = getattr(ctx, "ep", 1)
        # None when the expert TP is TP (plans and messages stay as they were)
        self.etp = sources.etp
        placed = model_rank_of(self.mesh, self.rank, self.ep, self.etp)
        megatron_says = (getattr(ctx, "ep_rank", 0), getattr(ctx, "etp_rank", placed.etp_rank))
        if (self.ep > 1 or self.etp is not None) and megatron_says != (placed.ep_rank, placed.etp_rank):
            raise ValueError(f"rank {self.rank}: megatron says (EP rank, expert TP rank) {megatron_says}, the "
                             f"resharder's expert mesh says {(placed.ep_rank, placed.etp_rank)}")
        self.plan: RankReshardPlan = build_rank_plan(
            self.shape, self.mesh, groups, self.rank,
            bucket_numel=max(1, self.config.bucket_bytes // element),
            gen_tp_index=tuple(gen_tp_index) if gen_tp_index is not None else None,
            use_tied_copy=self.config.use_tied_copy,
            ep=self.ep,
            etp=self.etp,
        )
        self._element = element
        self._gen_tp_index = tuple(gen_tp_index) if gen_tp_index is not None else None
        self._check_sources()
        dtype_name = _DTYPE_NAMES.get(self.dtype)
        self.traffic: ReshardTraffic | None = (
            reshard_traffic(self.shape, self.mesh, groups, dtype_name, ep=self.ep, etp=self.etp) if dtype_name else None
        )
        self.last_report: SyncReport | None = None
        self._synced_once = False


    def finished_report(self) -> SyncReport:
        """The report of the last sync whose `shards()` ran to its end."""
        if self.last_report is None:
            raise RuntimeError(f"rank {self.rank}: no weight sync has run to its end yet")
        return self.last_report
    def _plan_inputs(self) -> tuple:
        """Everything the plan depends on; it must be equal on every rank, or messages would not match."""
        return (self.shape, self.mesh, self.groups, str(self.dtype), self.config.bucket_bytes,
                self.config.use_tied_copy, self._gen_tp_index, self.ep, self.etp)

    def _check_ranks_agree(self) -> None:
        """First sync only: a clear error instead of a gloo size mismatch (or a hang) when ranks were
        configured differently. Also the world group's first collective, which NCCL requires before
        p2p batches that involve only some of its ranks."""
        inputs: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(inputs, self._plan_inputs())
        differing = [r for r, other in enumerate(inputs) if other != inputs[self.rank]]
        if differing:
            raise ValueError(f"rank {self.rank}: resharder settings differ on ranks {differing} (model shape, "
                             "mesh, groups, dtype, bucket size, tied-copy use or generation TP indices)")

    def _check_sources(self) -> None:
        for bucket in self.plan.buckets:
            for pieces in (*bucket.sends.values(), bucket.local):
                for piece in pieces:
                    if piece.mcore_name not in self._tensors[piece.chunk]:
                        raise KeyError(f"rank {self.rank}: the plan reads {piece.mcore_name} of chunk "
                                       f"{piece.chunk}, which the model does not have")

    # ---- the sync ---------------------------------------------------------------------------------
    def shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield this rank's vLLM tensors as they complete; `last_report` is set at the end.

        Collective: every rank of the DP/CP replica must exhaust its generator (and, on the first
        sync, every rank of the world enters a check that all ranks planned alike). The yielded tensors
        are new (never views of the training parameters), so the consumer may keep or modify them.
        """
        if not self._synced_once:
            self._check_ranks_agree()
        self._synced_once = True
        stats = ExchangeStats()
        yield from exchange(self.plan, self._tensors, WorldTransport(), dtype=self.dtype, device=self.device,
                            stats=stats, checksums=self.config.checksums, scratch=self._scratch)
        self.last_report = self._report(stats)

    def reshard(self) -> dict[str, torch.Tensor]:
        """All of this rank's vLLM tensors in one dict (tests and tools; `shards()` streams)."""
        return dict(self.shards())

    def _report(self, stats: ExchangeStats) -> SyncReport:
        plan, es = self.plan, self._element
        traffic = self.traffic
        return SyncReport(
            rank=self.rank,
            gen_tp_index=plan.gen_tp_index,
            infer_tp=plan.infer_tp,
            strategy=self.groups.strategy,
            bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received,
            messages_sent=stats.messages_sent,
            messages_received=stats.messages_received,
            buckets=len(plan.buckets),
            seconds=stats.seconds,
            checksum_seconds=stats.checksum_seconds,
            wait_seconds=stats.wait_seconds,
            wall_seconds=stats.wall_seconds,
            peak_buffer_bytes=stats.meter.peak_buffers,
            peak_extra_bytes=stats.meter.peak_total,
            generation_shard_bytes=plan.target_numel * es,
            planned_bytes_received=plan.recv_numel * es,
            exact_lower_bound_bytes=plan.lower_bound_numel * es,
            plan_bytes_received=traffic.bytes_received[self.rank] if traffic else None,
            plan_lower_bound_bytes=traffic.lower_bound[self.rank] if traffic else None,
            naive_gather_bytes=plan.naive_numel * es,
            peers=plan.peers,
            peers_outside_micro_dp=plan.peers_outside_micro_dp,
            checksums=stats.checksums,
        )


@dataclass(frozen=True)
class TrainingSources:
    """What a training rank sends from: its chunks' tensors by local-spec megatron name (per chunk)."""

    shape: Any  # the model's ModelShape
    tensors: list[Mapping[str, torch.Tensor]]
    device: torch.device
    params_dtype: torch.dtype
    ep: int
    etp: int | None = None  # the expert TP when it differs from TP


def training_sources(models: Sequence[Any], mesh: TrainingMesh, rank: int,
                     merge_adapters: bool = True) -> TrainingSources:
    """This rank's megatron chunks as the tensors a plan reads (`Piece.mcore_name` of `Piece.chunk`),
    checked against the mesh the plan lays the model out by; a LoRA actor's adapters merged in unless
    `merge_adapters` is false (its base weights alone)."""
    chunks = [unwrap_model(m) for m in models]
    infos = [chunk_info(m) for m in chunks]
    # the plan places layers by the mesh's split, the models were built by theirs: one layout
    built = infos[0].layout
    if mesh.layout(built.ep, built.etp) != built:
        raise ValueError(f"rank {rank}: the resharder's mesh lays the model out as "
                         f"{mesh.layout(built.ep, built.etp)}, its models were built as {built}")
    # mcore name (local spec) -> tensor, per chunk; TE specs rename the fused norms (per layer: chunk_tensors).
    tensors: list[Mapping[str, torch.Tensor]] = [{name: t.detach() for name, t in chunk_tensors(model)[1].items()}
                                                 for model in chunks]
    first = next(iter(tensors[0].values()))
    # A LoRA actor's adapters are merged into the weights they adapt as these are read (`lora.merged_weights`).
    merged = ([merged_weights(model, chunk) for model, chunk in zip(chunks, tensors, strict=True)]
              if merge_adapters else tensors)
    return TrainingSources(infos[0].source.shape, merged, first.device, chunks[0].config.params_dtype,
                           built.ep, built.etp)


class RolloutPlacementError(ValueError):
    """The rollout engine's TP rank on this process is not the generation shard the resharder builds."""


def check_rollout_placement(resharder: Resharder, vllm_tp_rank: int) -> None:
    """Refuse to deliver a shard to an engine whose TP rank differs from the planned generation index.

    vLLM's external_launcher builds its TP groups from consecutive ranks (vLLM TP rank = rank %
    infer_tp); the Plan's strided groups (training TP a multiple k > 1 of inference TP) put replica
    members k ranks apart. Until the rollout engine can build its TP groups from
    `ReshardGroups.rollout.replicas`, build the resharder with
    `gen_tp_index=[r % infer_tp for r in range(world)]` (correct, but more traffic: see bench/reshard.py).
    """
    if resharder.plan.gen_tp_index != vllm_tp_rank:
        raise RolloutPlacementError(
            f"rank {resharder.rank}: vLLM serves TP rank {vllm_tp_rank} of {resharder.plan.infer_tp}, the "
            f"resharder builds generation shard {resharder.plan.gen_tp_index} ({resharder.groups.strategy} "
            "groups); build the Resharder with gen_tp_index matching the engine's TP groups"
        )
