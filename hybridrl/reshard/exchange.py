"""Carrying out one rank's part of a weight-sync plan: pack, send, receive, assemble, digest.

A `RankReshardPlan` (from `reshard_plan.build_rank_plan`, the colocated policy's, or
`cross_pool_plan.build_cross_pool_plan`, the disaggregated rollout's) says, bucket by bucket, which
pieces this rank sends to whom, receives from whom and copies locally, and when each of its vLLM
tensors opens and completes. `exchange` runs it and yields each tensor as soon as its last piece
lands; how messages travel is the `Transport`'s business:

- `WorldTransport`: the default process group's `batch_isend_irecv` (the colocated policy: every rank
  both sends and receives, so the batched form is what keeps it deadlock-free on NCCL);
- `CrossGroupTransport`: a `parallel.cross_group.CrossGroup` between two pools (one-way traffic).
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hybridrl.models.vllm_layout import split_slot_name, stacked_params
from hybridrl.reshard.checksums import tensor_checksum
from hybridrl.reshard.reshard_plan import Piece, RankBucket, RankReshardPlan


class Transport(Protocol):
    def post(self, sends: Sequence[tuple[int, torch.Tensor]],
             recvs: Sequence[tuple[int, torch.Tensor]]) -> list[Any]:
        """Start every send and receive of one bucket; return the works to wait on."""


class WorldTransport:
    """Point-to-point over the default process group, peers by global rank."""

    def post(self, sends: Sequence[tuple[int, torch.Tensor]],
             recvs: Sequence[tuple[int, torch.Tensor]]) -> list[Any]:
        ops = [dist.P2POp(dist.isend, tensor, peer) for peer, tensor in sends]
        ops += [dist.P2POp(dist.irecv, tensor, peer) for peer, tensor in recvs]
        return dist.batch_isend_irecv(ops) if ops else []


class CrossGroupTransport:
    """Point-to-point over a cross-pool group, peers by member index."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def post(self, sends: Sequence[tuple[int, torch.Tensor]],
             recvs: Sequence[tuple[int, torch.Tensor]]) -> list[Any]:
        works = [self.group.recv(tensor, peer) for peer, tensor in recvs]
        works += [self.group.send(tensor, peer) for peer, tensor in sends]
        return works


class MemoryMeter:
    """Bytes of the buffers we allocated that are still alive, and the peak of that."""

    def __init__(self) -> None:
        self.buffers = 0
        self.outputs = 0
        self.peak_buffers = 0
        self.peak_total = 0

    def add(self, nbytes: int, *, output: bool = False) -> None:
        if output:
            self.outputs += nbytes
        else:
            self.buffers += nbytes
        self.peak_buffers = max(self.peak_buffers, self.buffers)
        self.peak_total = max(self.peak_total, self.buffers + self.outputs)

    def remove(self, nbytes: int, *, output: bool = False) -> None:
        if output:
            self.outputs -= nbytes
        else:
            self.buffers -= nbytes


@dataclass
class ExchangeStats:
    """What one run of a plan measured on this rank (filled while the generator runs)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    seconds: float = 0.0  # inside the exchange (the consumer's time between yields excluded)
    checksum_seconds: float = 0.0
    wait_seconds: float = 0.0  # part of `seconds` blocked on transfers (peers not ready, or the wire)
    wall_seconds: float = 0.0
    meter: MemoryMeter = field(default_factory=MemoryMeter)
    checksums: dict[str, str] = field(default_factory=dict)


class ScratchBuffers:
    """The send and receive buffers of a bucket carved from one flat tensor kept between syncs.

    Where freshly allocated memory is dear (host memory: every page of a new buffer is faulted in
    and zeroed, ~40 us a page on this project's VMs, so a 212 MB receive took seconds in the
    trainer), the resharder keeps the largest bucket's buffers for the next sync instead of
    allocating them anew (`DevicePolicy.reshard_keeps_buffers`). On GPUs the memory is given back
    to training, as HybridFlow does."""

    def __init__(self) -> None:
        self._flat: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._flat.values())

    def carve(self, numels: Sequence[int], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        """Disjoint 1-D views of `numels` elements each (contents undefined), from the kept tensor,
        grown when a bucket needs more than any before."""
        key = (dtype, torch.device(device))
        flat = self._flat.get(key)
        total = sum(numels)
        if flat is None or flat.numel() < total:
            self._flat.pop(key, None)  # the old one is freed before the larger one is taken
            flat = self._flat[key] = torch.empty(total, dtype=dtype, device=device)
        views, start = [], 0
        for numel in numels:
            views.append(flat[start:start + numel])
            start += numel
        return views


def stacked_slots(plan: RankReshardPlan) -> dict[str, list[str]]:
    """Stacked vLLM parameters (MoE experts) -> their slots' planning names, in slot order."""
    return {param: names for param, names in stacked_params(plan.targets).items()
            if split_slot_name(names[0])[1] is not None}


def exchange(plan: RankReshardPlan, sources: Sequence[Mapping[str, torch.Tensor]], transport: Transport, *,
             dtype: torch.dtype, device: torch.device, stats: ExchangeStats,
             checksums: bool = True, scratch: ScratchBuffers | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Run `plan` on this rank; yield `(vLLM name, tensor)` as each completes (new tensors, never views
    of `sources`). `sources[chunk][mcore name]` are the tensors this rank sends from (empty on a rank
    that only receives). `scratch`: where send/receive buffers come from (None: allocated per bucket).
    Collective: every rank of the plan must exhaust its generator."""
    element = torch.empty((), dtype=dtype).element_size()
    stacked = stacked_slots(plan)
    outputs: dict[str, torch.Tensor] = {}
    stacks: dict[str, torch.Tensor] = {}  # stacked expert parameters being filled, slot by slot
    waiting = {param: len(names) for param, names in stacked.items()}
    meter = stats.meter
    started = time.perf_counter()
    for bucket in plan.buckets:
        resumed = time.perf_counter()
        for name in bucket.opens:
            target = plan.targets[name]
            has_padding = any(seg.hf_name is None for seg in target.segments)
            make = torch.zeros if has_padding else torch.empty
            param, slot = split_slot_name(name)
            if slot is None:
                outputs[name] = make(target.shape, dtype=dtype, device=device)
                meter.add(outputs[name].numel() * element, output=True)
                continue
            if param not in stacks:  # one allocation for all experts; each slot is a view of it
                stacks[param] = make((len(stacked[param]), *target.shape), dtype=dtype, device=device)
                meter.add(stacks[param].numel() * element, output=True)
            outputs[name] = stacks[param][stacked[param].index(name)]
        _run_bucket(bucket, sources, outputs, transport, dtype, device, element, stats, scratch)
        ready = []
        for name in bucket.completes:
            tensor = outputs.pop(name)
            param, slot = split_slot_name(name)
            if slot is not None:
                waiting[param] -= 1
                if waiting[param]:
                    continue
                name, tensor = param, stacks.pop(param)
            meter.remove(tensor.numel() * element, output=True)
            if checksums:
                digest_started = time.perf_counter()
                stats.checksums[name] = tensor_checksum(tensor)
                stats.checksum_seconds += time.perf_counter() - digest_started
            ready.append((name, tensor))
        stats.seconds += time.perf_counter() - resumed
        yield from ready
    if outputs or stacks:
        raise AssertionError(f"plan bug: tensors never completed: {sorted(outputs) + sorted(stacks)}")
    stats.wall_seconds = time.perf_counter() - started


def _source_view(sources: Sequence[Mapping[str, torch.Tensor]], piece: Piece) -> torch.Tensor:
    tensor = sources[piece.chunk][piece.mcore_name]
    return tensor if piece.axis is None else tensor.narrow(piece.axis, piece.src_offset, piece.length)


def _target_view(output: torch.Tensor, piece: Piece) -> torch.Tensor:
    return output if piece.axis is None else output.narrow(piece.axis, piece.dst_offset, piece.length)


def _sendable_as_is(sources: Sequence[Mapping[str, torch.Tensor]], pieces: Sequence[Piece],
                    dtype: torch.dtype) -> torch.Tensor | None:
    """The one piece's source view as a flat tensor when it can be sent without a copy (rows of a
    row-major tensor in the transfer dtype), else None."""
    if len(pieces) == 1:
        view = _source_view(sources, pieces[0])
        if view.is_contiguous() and view.dtype == dtype:
            return view.reshape(-1)
    return None


def _piece_key(pieces: Sequence[Piece]) -> tuple:
    return tuple((p.chunk, p.mcore_name, p.axis, p.src_offset, p.length) for p in pieces)


def _pack_into(buffer: torch.Tensor, sources: Sequence[Mapping[str, torch.Tensor]], pieces: Sequence[Piece]) -> None:
    """The pieces in order into the contiguous 1-D `buffer`."""
    position = 0
    for piece in pieces:
        buffer[position: position + piece.numel].view(piece.shape).copy_(_source_view(sources, piece))
        position += piece.numel


def _run_bucket(bucket: RankBucket, sources: Sequence[Mapping[str, torch.Tensor]], outputs: dict[str, torch.Tensor],
                transport: Transport, dtype: torch.dtype, device: torch.device, element: int,
                stats: ExchangeStats, scratch: ScratchBuffers | None = None) -> None:
    meter = stats.meter
    # one packed buffer per distinct piece list (shared by receivers); a lone contiguous piece is sent as is
    packed: dict[tuple, torch.Tensor] = {}
    pieces_of: dict[tuple, Sequence[Piece]] = {}
    to_pack: list[tuple] = []
    send_keys: list[tuple[int, tuple]] = []
    for dst, pieces in bucket.sends.items():
        key = _piece_key(pieces)
        send_keys.append((dst, key))
        if key not in pieces_of:
            pieces_of[key] = pieces
            view = _sendable_as_is(sources, pieces, dtype)
            if view is None:
                to_pack.append(key)
            else:
                packed[key] = view
    numels = [sum(p.numel for p in pieces_of[key]) for key in to_pack]
    numels += [sum(p.numel for p in pieces) for pieces in bucket.recvs.values()]
    buffers = (scratch.carve(numels, dtype, device) if scratch is not None
               else [torch.empty(n, dtype=dtype, device=device) for n in numels])
    allocated = sum(numels) * element
    meter.add(allocated)
    for key, buffer in zip(to_pack, buffers):
        _pack_into(buffer, sources, pieces_of[key])
        packed[key] = buffer
    sends: list[tuple[int, torch.Tensor]] = []
    for dst, key in send_keys:
        buffer = packed[key]
        sends.append((dst, buffer))
        stats.bytes_sent += buffer.numel() * element
        stats.messages_sent += 1
    receive = dict(zip(bucket.recvs, buffers[len(to_pack):]))
    works = transport.post(sends, list(receive.items()))
    # Local copies overlap with the transfers in flight.
    for piece in bucket.local:
        _target_view(outputs[piece.target], piece).copy_(_source_view(sources, piece))
    waiting = time.perf_counter()
    for work in works:
        work.wait()
    stats.wait_seconds += time.perf_counter() - waiting
    for src, pieces in bucket.recvs.items():
        buffer = receive[src]
        stats.bytes_received += buffer.numel() * element
        stats.messages_received += 1
        position = 0
        for piece in pieces:
            part = buffer[position: position + piece.numel].view(piece.shape)
            _target_view(outputs[piece.target], piece).copy_(part)
            position += piece.numel
    meter.remove(allocated)
