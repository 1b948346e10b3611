"""The weight sync of a LoRA actor whose adapters vLLM serves itself (`actor_rollout_ref.model.lora.merge: false`).

The base is frozen: the resharder moves it into vLLM once (unmerged), and every sync after that moves the adapters
alone. vLLM's LoRA support loads an adapter from a Hugging Face PEFT folder and shards it over its own TP ranks, so
every rollout rank needs the whole adapter: each pipeline stage's adapters are gathered over TP (`lora.lora_state`)
and broadcast from the stage's first holder (TP, DP and CP rank 0) to every rank. Each rank then writes the adapter
to a folder of its own and vLLM loads it as a new adapter id (`RolloutEngine.serve_adapter`).

Proof, as for merged syncs: the digests of what vLLM's LoRA manager loaded (in vLLM's LoRA dtype, with alpha / rank
folded into B as vLLM does) must equal those of the tensors this rank sent (`served_adapter_digests`), and the
log-prob probe then compares what serves, adapter applied, with the trainer's forward.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridrl.models.lora import LoraAdapter, lora_state
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
    sources: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(sources, (pp_rank, first_holder))
    stage_sources = {}
    for rank, (stage, first) in enumerate(sources):  # type: ignore[misc]
        if first:
            stage_sources.setdefault(stage, rank)
    me = dist.get_rank()
    state: dict[str, torch.Tensor] = {}
    received = 0
    for stage, src in sorted(stage_sources.items()):
        box = [own if me == src else None]
        dist.broadcast_object_list(box, src=src)
        part: dict[str, torch.Tensor] = box[0]  # type: ignore[assignment]
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
