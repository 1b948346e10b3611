"""The weight sync of a LoRA actor whose adapters vLLM serves itself (`actor_rollout_ref.model.lora.merge: false`).

The base is frozen: the resharder moves it into vLLM once (unmerged), and every sync after that moves the adapters
alone. vLLM's LoRA support loads an adapter from a Hugging Face PEFT folder and shards it over its own TP ranks, so
every rollout rank needs the whole adapter: each pipeline stage's adapters are gathered over TP (`lora.lora_state`)
and broadcast from the stage's first holder (TP, DP and CP rank 0) to every rank. Each rank then writes the adapter
to a folder of its own and vLLM loads it as a new adapter id (`RolloutEngine.serve_adapter`).

Proof, as for merged syncs: the digests of what vLLM's LoRA manager loaded (in vLLM's LoRA dtype, with alpha / rank
folded into B as vLLM does) must equal those of the tensors this rank sent (`served_adapter_digests`), and the
log-prob probe then compares what serves, adapter applied, with the trainer's forward.

With a disaggregated rollout (`rollout.mode: disaggregated`) the rollout pool holds no adapter: after the same
gather, every training rank has the whole adapter, and training rank r ships the PEFT folder's files
(`models.lora.peft_adapter_files`) with the digests vLLM must end up holding to the rollout ranks q with
q mod trainer_world = r (`send_adapter` / `receive_adapter`, over the cross-pool group: the sends spread over the
trainer pool). The group moves tensors only (gloo or NCCL point-to-point, no object transport outside a
registered world), so the files travel as one uint8 tensor behind its length: a JSON header (each file's size,
the digests, the adapter's tensor bytes), then the files' bytes.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridrl.config.meshes import adapter_receivers, adapter_sender
from hybridrl.models.lora import LoraAdapter, lora_state
from hybridrl.parallel.cross_group import CrossGroup
from hybridrl.parallel.digest import tensor_digest
from hybridrl.parallel.state import ParallelContext


@dataclass(frozen=True)
class AdapterSync:
    """One rank's whole adapter for vLLM, and what reaching it cost."""

    state: dict[str, torch.Tensor]  # peft name -> whole tensor (every stage's)
    # the other stages' adapters, broadcast to this rank (the world broadcast of its own stage, which it already
    # holds after the TP gather, also reaches it and is not counted)
    bytes_received: int
    adapter_bytes: int  # the whole adapter's tensors


def gather_whole_adapters(adapters: Sequence[LoraAdapter], ctx: ParallelContext) -> AdapterSync:
    """Collective over the whole world: every rank's copy of every stage's adapters, each stage's broadcast by its
    first holder (TP, DP and CP rank 0)."""
    own = lora_state(adapters)  # collective over each adapter's TP group
    pp_rank = ctx.pp_rank
    first_holder = ctx.tp_rank == 0 and ctx.dp_rank == 0 and ctx.cp_rank == 0
    sources: list[tuple[int, bool] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(sources, (pp_rank, first_holder))
    stage_sources: dict[int, int] = {}  # pipeline stage -> the rank that broadcasts its adapters
    for rank, source in enumerate(sources):
        if source is None:
            raise RuntimeError(f"rank {rank} gave no (pipeline stage, first holder) to the all-gather")
        stage, first = source
        if first:
            stage_sources.setdefault(stage, rank)
    me = dist.get_rank()
    state: dict[str, torch.Tensor] = {}
    received = 0
    for stage, src in sorted(stage_sources.items()):
        box: list[dict[str, torch.Tensor] | None] = [own if me == src else None]
        dist.broadcast_object_list(box, src=src)
        part = box[0]
        if part is None:
            raise RuntimeError(f"rank {src} broadcast no adapters of pipeline stage {stage}")
        if stage != pp_rank:
            received += sum(t.numel() * t.element_size() for t in part.values())
        state.update(own if stage == pp_rank else part)
    return AdapterSync(state, received, sum(t.numel() * t.element_size() for t in state.values()))


def served_adapter_digests(state: Mapping[str, torch.Tensor], scaling: float, dtype: torch.dtype) -> dict[str, str]:
    """The digests vLLM's LoRA manager holds after loading `state`: each tensor cast to vLLM's LoRA dtype, B then
    multiplied by alpha / rank in that dtype (vLLM's `LoRALayerWeights.optimize`)."""
    out = {}
    for name, tensor in state.items():
        value = tensor.to(dtype=dtype, copy=True)
        if ".lora_B." in name and scaling != 1:
            value *= scaling
        out[name] = tensor_digest(value)
    return out


@dataclass(frozen=True)
class ShippedAdapter:
    """A PEFT adapter folder as it crosses the pools: its files, the digests vLLM must hold once it has loaded them
    (`served_adapter_digests`), and its tensors' bytes (`AdapterSync.adapter_bytes`)."""

    files: dict[str, bytes]
    digests: dict[str, str]
    adapter_bytes: int

    def pack(self) -> bytes:
        names = sorted(self.files)
        header = json.dumps({"files": [[name, len(self.files[name])] for name in names], "digests": self.digests,
                             "adapter_bytes": self.adapter_bytes}).encode()
        return len(header).to_bytes(8, "little") + header + b"".join(self.files[name] for name in names)

    @classmethod
    def unpack(cls, payload: bytes) -> ShippedAdapter:
        size = int.from_bytes(payload[:8], "little")
        header = json.loads(payload[8:8 + size])
        files, offset = {}, 8 + size
        for name, length in header["files"]:
            files[name] = payload[offset:offset + length]
            offset += length
        if offset != len(payload):
            raise ValueError(f"an adapter payload of {len(payload)} B whose header accounts for {offset} B")
        return cls(files, header["digests"], header["adapter_bytes"])


def send_adapter(group: CrossGroup, adapter: ShippedAdapter, *, rank: int, device: torch.device) -> int:
    """Training rank `rank`'s side: the packed adapter to each rollout rank it serves (`adapter_receivers`), its
    length first; returns the bytes sent. Collective with every rollout rank's `receive_adapter`."""
    address = group.address
    targets = adapter_receivers(rank, address.trainer_world, address.rollout_world)
    if not targets:
        return 0
    packed = adapter.pack()
    payload = torch.frombuffer(bytearray(packed), dtype=torch.uint8).to(device)
    length = torch.tensor([len(packed)], dtype=torch.int64).to(device)
    for q in targets:
        member = address.member_of_rollout(q)
        group.send(length, member).wait()
        group.send(payload, member).wait()
    return len(targets) * (len(packed) + 8)


def receive_adapter(group: CrossGroup, *, rollout_rank: int, device: torch.device) -> tuple[ShippedAdapter, int]:
    """Rollout rank `rollout_rank`'s side: the adapter its training rank ships, and the bytes received."""
    source = group.address.member_of_trainer(adapter_sender(rollout_rank, group.address.trainer_world))
    length = torch.zeros(1, dtype=torch.int64, device=device)
    group.recv(length, source).wait()
    payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    group.recv(payload, source).wait()
    return ShippedAdapter.unpack(payload.cpu().numpy().tobytes()), payload.numel() + 8
