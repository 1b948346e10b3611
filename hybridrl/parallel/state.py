"""Process groups and megatron-core parallel state for one training process.

Call order on every rank of a worker group:

    init_distributed(rank, world_size, addr, port, device)      # torch.distributed (nccl | gloo)
    ctx = initialize_model_parallel(tp, pp, vpp, cp, seed, device)   # megatron groups + RNG
    ...                                                           # build models with ctx
    destroy_model_parallel()

`initialize_model_parallel` installs the CPU layer (`hybridrl.parallel.cpu.layer`) when the device is
cpu, so megatron-core runs unchanged on gloo. It returns a frozen `ParallelContext`; `get_context()`
returns the current one.

This module is preloaded by the forked-rank launcher's server: keep its import cheap (torch, megatron
and the CPU layer, `cpu_layer` and `cpu_matmul`, which import torch, are imported inside the functions).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from hybridrl.parallel.device import dist_backend_for, resolve_device
from hybridrl.parallel.device_policy import DevicePolicy

if TYPE_CHECKING:
    import torch.distributed as dist

_context: ParallelContext | None = None


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in the (tp, cp, dp, pp) mesh, with megatron's groups for each axis.

    Megatron orders ranks tp fastest, then cp, dp, pp ("tp-cp-ep-dp-pp"), so ranks
    [0, tp) form the first TP group, and pipeline stages are world/pp ranks apart.
    """

    device: str
    world_size: int
    rank: int
    tp: int
    pp: int
    cp: int
    dp: int
    vpp: int | None
    tp_rank: int
    pp_rank: int
    cp_rank: int
    dp_rank: int
    seed: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    # DP x CP: the group megatron's DDP reduces gradients over when CP > 1.
    dp_cp_group: dist.ProcessGroup
    model_parallel_group: dist.ProcessGroup
    # Expert parallelism (MoE): megatron's expert rank generator lays the expert mesh out
    # etp-ep-edp-pp (etp fastest) over the same ranks; experts are split over the `ep` ranks of an
    # EP group, and `expert_dp_rank` numbers the replicas of one EP rank's experts.
    ep: int = 1
    ep_rank: int = 0
    expert_dp_rank: int = 0
    ep_group: dist.ProcessGroup | None = None
    # expert tensor parallelism: each expert split over `etp` ranks (None: tp), this rank's part `etp_rank`
    etp: int | None = None
    etp_rank: int = 0
    # megatron's num_layers_in_first/last_pipeline_stage (None: even). Not parallel state to megatron
    # (TransformerConfig carries them), but where this rank's layers sit: the bridge builds the
    # models' layout from them (`ParallelLayout.of_context`), the resharder its mesh.
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    @property
    def is_first_pp_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} on {self.device}: tp {self.tp_rank}/{self.tp}, "
            f"pp {self.pp_rank}/{self.pp}, cp {self.cp_rank}/{self.cp}, dp {self.dp_rank}/{self.dp}"
            + (f", vpp {self.vpp}" if self.vpp else "")
            + (f", ep {self.ep_rank}/{self.ep}" if self.ep > 1 else "")
            + (f", etp {self.etp_rank}/{self.etp}" if self.etp not in (None, self.tp) else "")
            + (f", stage layers first {self.first_stage_layers} last {self.last_stage_layers}"
               if self.first_stage_layers is not None or self.last_stage_layers is not None else "")
        )


def validate_layout(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, vpp: int | None = None,
                    ep: int = 1, etp: int | None = None) -> int:
    """Check a parallel layout against the world size; return the data-parallel size.

    Raises ValueError naming the values when a size is not positive, when world_size is not
    divisible by tp * pp * cp, or when megatron's expert mesh (ep x etp, `etp` None: tp) does not
    tile a pipeline stage's tp * cp * dp ranks (with etp = tp: ep divides dp * cp).
    """
    sizes = {"world_size": world_size, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": tp if etp is None else etp}
    bad = [f"{name}={value}" for name, value in sizes.items() if not isinstance(value, int) or value < 1]
    if bad:
        raise ValueError(f"parallel sizes must be positive integers: {', '.join(bad)}")
    model_parallel = tp * pp * cp
    if world_size % model_parallel != 0:
        raise ValueError(
            f"world_size={world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {model_parallel}"
        )
    if etp is None or etp == tp:
        if (world_size // model_parallel * cp) % ep:
            raise ValueError(f"ep={ep} does not divide dp*cp = {world_size // model_parallel * cp} "
                             f"(world_size={world_size}, tp={tp}, pp={pp})")
    elif (world_size // pp) % (ep * etp):
        raise ValueError(f"ep*etp = {ep}*{etp} does not divide a pipeline stage's tp*cp*dp = {world_size // pp} "
                         f"ranks (world_size={world_size}, pp={pp})")
    if vpp is not None:
        if not isinstance(vpp, int) or vpp < 1:
            raise ValueError(f"vpp={vpp} must be None or a positive integer")
        if vpp > 1 and pp < 2:
            raise ValueError(f"vpp={vpp} (virtual pipeline stages) needs pp >= 2, got pp={pp}")
    return world_size // model_parallel


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    device: str = "cpu",
    timeout_s: float = 1800.0,
) -> str:
    """Join the default torch.distributed group (nccl on cuda, gloo on cpu); return the backend.

    `timeout_s` bounds every collective of the group (`trainer.nccl_timeout_s`, 30 min by default):
    long enough for peers waiting while rank 0 alone writes a checkpoint or an HF export; a dead
    rank is caught sooner by the controller, which kills the whole group. Safe to call when the
    default group already exists with the same rank and world size (returns its backend); a
    different world is an error.
    """
    import torch
    import torch.distributed as dist

    resolved = resolve_device(device)
    dist_backend = dist_backend_for(resolved)
    if dist.is_initialized():
        have = (dist.get_rank(), dist.get_world_size())
        if have != (rank, world_size):
            raise RuntimeError(
                f"torch.distributed is already initialized as rank {have[0]} of {have[1]}, "
                f"not rank {rank} of {world_size}"
            )
        return str(dist.get_backend())
    if resolved == "cuda":
        # One GPU per process; LOCAL_RANK is set by torchrun/Ray, else rank modulo visible devices.
        local_rank = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        dist_backend,
        rank=rank,
        world_size=world_size,
        init_method=f"tcp://{master_addr}:{master_port}",
        timeout=timedelta(seconds=timeout_s),
    )
    return dist_backend


def initialize_model_parallel(
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    cp: int = 1,
    seed: int = 1234,
    device: str = "cpu",
    timeout_s: float | None = None,
    ep: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    etp: int | None = None,
) -> ParallelContext:
    """Create megatron-core's parallel groups for (tp, pp, vpp, cp, ep, etp) and seed its RNG streams.

    `first_stage_layers` / `last_stage_layers` (an uneven pipeline split, megatron's
    num_layers_in_first/last_pipeline_stage) are only recorded in the context; the model's layer
    count checks them when models are built.

    `ep` is the expert-parallel size of an MoE model, `etp` its expert tensor-parallel size (None:
    tp, megatron's default); megatron's expert rank generator lays them out etp-ep-edp-pp.

    torch.distributed must be initialized. On cpu the CPU layer is installed first. The groups'
    timeout is `timeout_s`, by default the world group's own (the worker group sets that one from
    `trainer.nccl_timeout_s`), rounded up to whole minutes (megatron's unit); megatron's own
    default would be 30 minutes whatever the job asked for. Seeding follows
    Megatron-LM's training setup: each pipeline stage uses `stage_seed = seed + 100 * pp_rank`
    (so stages holding different layers do not initialize them identically); the default generator
    gets `stage_seed` (equal across TP and DP, megatron's data-parallel stream) and the tracker's
    model-parallel stream gets stage_seed + 2718 + tp_rank (distinct per TP rank, equal across DP),
    so TP shards initialize and drop out independently while DP replicas stay identical.
    """
    import torch.distributed as dist

    global _context
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_distributed() first")
    resolved = resolve_device(device)
    world_size = dist.get_world_size()
    dp = validate_layout(world_size, tp, pp, cp, vpp, ep, etp)
    etp = tp if etp is None else etp
    if timeout_s is None:
        timeout_s = process_group_timeout_s()
    if timeout_s is None:
        raise RuntimeError("cannot read the default process group's timeout from this torch build: pass timeout_s")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s} must be a positive number of seconds")
    if resolved == "cpu":
        from hybridrl.parallel.cpu.layer import apply_cpu_layer
        from hybridrl.parallel.cpu.matmul import route_fp32_matmul_to_onednn

        apply_cpu_layer()
        route_fp32_matmul_to_onednn()
    if DevicePolicy.for_device(resolved).flush_denormals:
        import torch

        torch.set_flush_denormal(True)

    from megatron.core import parallel_state as mps

    if mps.model_parallel_is_initialized():
        raise RuntimeError(
            "megatron model parallel is already initialized in this process; "
            "call destroy_model_parallel() before initializing again"
        )
    mps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
    )
    seed_model_parallel(stage_seed(seed, mps.get_pipeline_model_parallel_rank()), resolved)
    _context = dataclasses.replace(_build_context(resolved, seed, tp, pp, cp, dp, vpp, ep, etp),
                                   first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers)
    return _context


def process_group_timeout_s(group: dist.ProcessGroup | None = None) -> float | None:
    """The timeout a process group (default: the world group) was created with, in seconds.

    Read from the group's backend options (torch keeps no public accessor); None where this torch
    build does not expose them.
    """
    import torch
    import torch.distributed as dist

    group = group if group is not None else dist.distributed_c10d._get_default_group()
    name = str(dist.get_backend(group))
    device = torch.device("cuda" if "nccl" in name else "cpu")
    get_backend = getattr(group, "_get_backend", None)
    if get_backend is None:
        return None
    options = getattr(get_backend(device), "options", None)
    timeout = getattr(options, "_timeout", None)
    return None if timeout is None else timeout.total_seconds()


def stage_seed(seed: int, pp_rank: int) -> int:
    """The seed a pipeline stage uses (Megatron-LM's `seed + 100 * pp_rank`)."""
    return seed + 100 * pp_rank


def seed_model_parallel(seed: int, device: str) -> None:
    """Seed python/numpy/torch's default generators with `seed` and megatron's tracker streams.

    On GPU this is megatron's `model_parallel_cuda_manual_seed`; on CPU the same function runs on
    the CPU layer's tracker, and the CPU default generator (megatron's "default" stream on GPU is the
    CUDA one) is seeded here, since `torch.cuda.manual_seed` does nothing without CUDA.
    """
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if device == "cpu":
        from hybridrl.parallel.cpu.layer import cpu_layer_active

        if not cpu_layer_active():
            raise RuntimeError("seeding megatron on cpu needs the CPU layer (apply_cpu_layer())")
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _build_context(
    device: str, seed: int, tp: int, pp: int, cp: int, dp: int, vpp: int | None, ep: int = 1, etp: int | None = None
) -> ParallelContext:
    import torch.distributed as dist
    from megatron.core import parallel_state as mps

    ctx = ParallelContext(
        device=device,
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        tp=tp, pp=pp, cp=cp, dp=dp, vpp=vpp,
        tp_rank=mps.get_tensor_model_parallel_rank(),
        pp_rank=mps.get_pipeline_model_parallel_rank(),
        cp_rank=mps.get_context_parallel_rank(),
        dp_rank=mps.get_data_parallel_rank(),
        seed=seed,
        tp_group=mps.get_tensor_model_parallel_group(),
        pp_group=mps.get_pipeline_model_parallel_group(),
        cp_group=mps.get_context_parallel_group(),
        dp_group=mps.get_data_parallel_group(),
        dp_cp_group=mps.get_data_parallel_group(with_context_parallel=True),
        model_parallel_group=mps.get_model_parallel_group(),
        ep=ep,
        ep_rank=mps.get_expert_model_parallel_rank(),
        expert_dp_rank=mps.get_expert_data_parallel_rank(),
        ep_group=mps.get_expert_model_parallel_group(),
        etp=tp if etp is None else etp,
        etp_rank=mps.get_expert_tensor_parallel_rank(),
    )
    # Megatron's own bookkeeping must agree with the layout we asked for.
    sizes = (
        mps.get_tensor_model_parallel_world_size(), mps.get_pipeline_model_parallel_world_size(),
        mps.get_context_parallel_world_size(), mps.get_data_parallel_world_size(),
        mps.get_expert_model_parallel_world_size(), mps.get_expert_tensor_parallel_world_size(),
    )
    wanted = (tp, pp, cp, dp, ep, ctx.etp)
    if sizes != wanted:
        raise RuntimeError(f"megatron reports (tp, pp, cp, dp, ep, etp) = {sizes}, expected {wanted}")
    return ctx


def failed_ranks(ok: bool, detail: str) -> list[str]:
    """Collective over the world: `rank R: detail` for each rank that reports not `ok` (same on every rank).

    Every rank calls it after a step that may fail locally, so all of them raise together and none
    is left waiting in a later collective.
    """
    import torch.distributed as dist

    statuses: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(statuses, (ok, detail))
    return [f"rank {r}: {d}" for r, (good, d) in enumerate(statuses) if not good]


def get_context() -> ParallelContext:
    """The context made by the last `initialize_model_parallel` in this process."""
    if _context is None:
        raise RuntimeError("model parallel is not initialized: call initialize_model_parallel() first")
    return _context


def is_initialized() -> bool:
    return _context is not None


def destroy_model_parallel() -> None:
    """Tear down megatron's groups and forget the context (torch.distributed stays up).

    The CPU layer stays installed and subnormals stay flushed: both are process-wide and harmless
    between initializations.
    """
    global _context
    from megatron.core import parallel_state as mps

    mps.destroy_model_parallel()
    _context = None


def context_as_dict(ctx: ParallelContext) -> dict[str, Any]:
    """The picklable part of a context (sizes and ranks), e.g. to return from a worker."""
    groups = {"tp_group", "pp_group", "cp_group", "dp_group", "dp_cp_group", "model_parallel_group", "ep_group"}
    return {k: getattr(ctx, k) for k in ParallelContext.__dataclass_fields__ if k not in groups}
