"""The cross-pool weight sync (`rollout.mode: disaggregated`): training ranks send, vLLM ranks receive.

    # every training rank (after megatron's parallel state):
    sender = CrossPoolSender(models, layout, group)          # once
    report = sender.send()                                    # each sync: returns when its sends are done
    # every rollout rank:
    receiver = CrossPoolReceiver(shape, layout, group, rollout_rank, dtype=..., device=...)
    rollout.update_weights(receiver.shards(), weight_format="vllm_shard")
    verify_checksums(receiver.last_report.checksums, rollout.parameter_digests(), rank)

What moves is `cross_pool_plan` (pure, the same on every member); how it moves is
`exchange.exchange` over a `CrossGroupTransport`. Both sides must use the same layout, transfer dtype
and bucket size: the first sync checks that every member planned alike (a fingerprint all-reduced
over the group) and names the difference instead of hanging in a mismatched receive.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from hybridrl.models.arch import ModelShape
from hybridrl.reshard.cross_pool_plan import CrossPoolLayout, build_cross_pool_plan
from hybridrl.reshard.exchange import CrossGroupTransport, ExchangeStats, ScratchBuffers, exchange
from hybridrl.reshard.resharder import DEFAULT_BUCKET_BYTES, training_sources


class CrossPoolPlanMismatch(RuntimeError):
    """Members of the cross-pool group planned the sync differently (layout, dtype or bucket size)."""


@dataclass(frozen=True)
class CrossPoolReport:
    """One member's account of one cross-pool sync (bytes counted in the send/receive code)."""

    member: int
    role: str  # "trainer" (sends) or "rollout" (receives)
    bytes_sent: int
    bytes_received: int
    messages_sent: int
    messages_received: int
    buckets: int
    seconds: float
    wall_seconds: float
    peak_buffer_bytes: int
    planned_bytes_sent: int
    planned_bytes_received: int
    # a rollout member: its shard's real bytes (it holds nothing, so it must receive them all);
    # a training member: everything sent, spread evenly over the training ranks
    lower_bound_bytes: int
    checksums: dict[str, str] = field(default_factory=dict)

    def as_metrics(self, prefix: str = "reshard/") -> dict[str, float]:
        skip = {"checksums", "role", "member"}
        out = {prefix + k: float(v) for k, v in asdict(self).items() if k not in skip}
        moved = self.bytes_sent if self.role == "trainer" else self.bytes_received
        out[prefix + "ratio_to_lower_bound"] = moved / self.lower_bound_bytes if self.lower_bound_bytes else 1.0
        return out


def _fingerprint(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big") >> 1


class _Member:
    def __init__(self, shape: ModelShape, layout: CrossPoolLayout, group: Any, member: int, dtype: torch.dtype,
                 bucket_bytes: int, keep_buffers: bool = False) -> None:
        self.layout = layout
        # send/receive buffers kept from one sync to the next (`DevicePolicy.reshard_keeps_buffers`)
        self._scratch = ScratchBuffers() if keep_buffers else None
        self.group = group
        self.member = member
        self.dtype = dtype
        self.element = torch.empty((), dtype=dtype).element_size()
        self.bucket_bytes = bucket_bytes
        self.plan = build_cross_pool_plan(shape, layout, member, bucket_numel=max(1, bucket_bytes // self.element))
        self._inputs = (shape, layout, str(dtype), bucket_bytes)
        self._checked = False
        self.last_report: CrossPoolReport | None = None

    def finished_report(self) -> CrossPoolReport:
        """The report of the last sync that ran to its end (`send`, or `shards` consumed)."""
        if self.last_report is None:
            raise RuntimeError(f"cross-pool member {self.member}: no sync has run to its end yet")
        return self.last_report

    def _check_agreement(self) -> None:
        if self._checked:
            return
        if not self.group.agree(_fingerprint(*self._inputs)):
            raise CrossPoolPlanMismatch(
                f"cross-pool member {self.member}: the trainer and rollout pools planned the weight sync "
                f"differently (model shape, layout, transfer dtype {self.dtype} or bucket {self.bucket_bytes} B); "
                "both must be built from the same Plan")
        self._checked = True

    def _report(self, role: str, stats: ExchangeStats) -> CrossPoolReport:
        plan, es = self.plan, self.element
        return CrossPoolReport(
            member=self.member, role=role, bytes_sent=stats.bytes_sent, bytes_received=stats.bytes_received,
            messages_sent=stats.messages_sent, messages_received=stats.messages_received, buckets=len(plan.buckets),
            seconds=stats.seconds, wall_seconds=stats.wall_seconds, peak_buffer_bytes=stats.meter.peak_buffers,
            planned_bytes_sent=plan.send_numel * es, planned_bytes_received=plan.recv_numel * es,
            lower_bound_bytes=plan.lower_bound_numel * es, checksums=dict(stats.checksums))


class CrossPoolSender(_Member):
    """A training rank's side: sends the ranges of its megatron chunks the plan gives it (a LoRA model's weights
    with its adapters merged in, or, `merge_adapters=False`, its frozen base alone: vLLM serves the adapters)."""

    def __init__(self, models: Sequence[Any], layout: CrossPoolLayout, group: Any, *, rank: int,
                 dtype: torch.dtype | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 keep_buffers: bool = False, merge_adapters: bool = True) -> None:
        sources = training_sources(models, layout.mesh, rank, merge_adapters=merge_adapters)
        if sources.ep != layout.ep:
            raise ValueError(f"rank {rank}: the model was built at EP {sources.ep}, the layout says {layout.ep}")
        super().__init__(sources.shape, layout, group, rank, dtype or sources.params_dtype, bucket_bytes, keep_buffers)
        self._sources = sources
        missing = [p.mcore_name for b in self.plan.buckets for ps in b.sends.values() for p in ps
                   if p.mcore_name not in sources.tensors[p.chunk]]
        if missing:
            raise KeyError(f"rank {rank}: the plan sends {sorted(set(missing))[:3]}, which the model does not have")

    def send(self) -> CrossPoolReport:
        """Collective over the cross-pool group: returns once every piece this rank owes has gone."""
        self._check_agreement()
        stats = ExchangeStats()
        for _ in exchange(self.plan, self._sources.tensors, CrossGroupTransport(self.group), dtype=self.dtype,
                          device=self._sources.device, stats=stats, checksums=False, scratch=self._scratch):
            raise AssertionError("a training member of the cross-pool plan produced a vLLM tensor")
        self.last_report = self._report("trainer", stats)
        return self.last_report


class CrossPoolReceiver(_Member):
    """A rollout rank's side: assembles its vLLM shard from what the training ranks send."""

    def __init__(self, shape: ModelShape, layout: CrossPoolLayout, group: Any, *, rollout_rank: int,
                 dtype: torch.dtype, device: torch.device | str,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, keep_buffers: bool = False) -> None:
        super().__init__(shape, layout, group, layout.rollout_member(rollout_rank), dtype, bucket_bytes, keep_buffers)
        self.device = torch.device(device)

    def shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield this rank's vLLM tensors as they complete (digested); `last_report` is set at the end."""
        self._check_agreement()
        stats = ExchangeStats()
        yield from exchange(self.plan, [], CrossGroupTransport(self.group), dtype=self.dtype, device=self.device,
                            stats=stats, checksums=True, scratch=self._scratch)
        self.last_report = self._report("rollout", stats)
