"""The Ray plumbing every worker class inherits: its rank, its torch.distributed group, its mesh.

Role workers (the policy, critic, reward model, teacher, rollout) subclass `Worker`, take the `RankContext`
as the first constructor argument and pass it up:

    class CriticWorker(Worker):
        def __init__(self, context: RankContext, plan: Plan):
            super().__init__(context)
            ...

The methods below are called by `WorkerGroup` during bring-up; a worker's own methods (`update_critic`...) are
called by the trainer through the group's dispatch helpers. After setting up megatron, a subclass overrides
`mesh_coords()` so the controller learns each rank's (dp, tp, pp, cp) position.

Rules for subclasses:
* Don't touch CUDA or torch.distributed in `__init__`: the group sets CUDA_VISIBLE_DEVICES and
  joins the process group after every actor is constructed. Build models in a setup method the
  trainer calls afterwards.
* In methods dispatched by DP, ranks that don't own the output (not the last pipeline stage, or
  TP/CP rank > 0) should return None: their results are dropped, and a returned batch still costs
  a transfer.
* Batches that arrive as arguments are read-only views of shared memory (`Batch.shared_keys`):
  replace columns freely, but call `make_writable()` before writing in place.
"""
from __future__ import annotations

import functools
import inspect
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, TypeVar

import ray

from hybridrl.controller.dispatch import MeshCoord
from hybridrl.parallel import state
from hybridrl.parallel.device import torch_threads_per_rank
from hybridrl.parallel.heap import built_without_collections

Part = TypeVar("Part")

# The worker's `RankContext.restart`, in its environment: what a process-global reader (the fault
# hook) sees of it.
RESTART_ENV = "HYBRIDRL_RESTART"


def interface_of(address: str) -> str | None:
    """The network interface holding the IPv4 `address`, or None (not found, or loopback)."""
    import psutil

    if address.startswith("127."):
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addresses):
            return name
    return None


@dataclass(frozen=True)
class RankContext:
    """Where a worker sits: its group's name (a `GroupName`), its global rank, and its place on its node."""

    group: str
    rank: int
    world_size: int
    node_rank: int
    local_rank: int
    local_world_size: int
    use_gpu: bool
    # How many times the run has restarted its workers in place before this one started
    # (`trainer.max_restarts`): 0 for the workers of the run's first start.
    restart: int = 0


# The calls that build a worker's parts (the controller calls one of them first; `setup` may call `init_model`)
BRING_UP_METHODS = ("setup", "init_model")


def _on_rank_device(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method`, run with this rank's GPU as the calling thread's current CUDA device (a bring-up call without
    automatic garbage collection: `built_without_collections`)."""
    bring_up = method.__name__ in BRING_UP_METHODS

    @functools.wraps(method)
    def call(self: Worker, *args: Any, **kwargs: Any) -> Any:
        self.use_rank_device()
        if bring_up:
            with built_without_collections():
                return method(self, *args, **kwargs)
        return method(self, *args, **kwargs)

    call.on_rank_device = True  # type: ignore[attr-defined]
    return call


class Worker:
    """Base class of all Ray worker classes: rank bookkeeping + process-group bring-up.

    Every public method of a worker class runs with the rank's GPU current (`use_rank_device`): CUDA's
    current device is a property of the calling thread, and Ray may run an actor's method on a thread
    other than the one that set it, where `torch.cuda.current_device()` (what megatron and vLLM allocate
    on) would be GPU 0.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, value in list(vars(cls).items()):
            if not name.startswith("_") and inspect.isfunction(value) and not getattr(value, "on_rank_device", False):
                setattr(cls, name, _on_rank_device(value))

    # the call that builds a worker's parts (`_require` names it when one is missing)
    BUILT_BY = "setup"

    def __init__(self, context: RankContext) -> None:
        self.context = context
        self.cores_shared_by = 0  # ranks running at once on this machine (`share_cores`); 0: the group's own
        self._export_rank_env()

    def _require(self, part: Part | None, what: str) -> Part:
        """A part the worker builds in `BUILT_BY` (its engine, its model), or an error naming the worker, the rank and
        what is missing."""
        if part is None:
            raise RuntimeError(f"{type(self).__name__} rank {self.rank}: {what} is not set up (call {self.BUILT_BY} "
                               "first)")
        return part

    def torch_threads(self, configured: int | None) -> int:
        """Intra-op threads for this rank: `trainer.torch_threads_per_rank`, else the machine's cores over the ranks
        that run on it at once (every pool's, once `share_cores` told; else the group's own on the node)."""
        return configured or torch_threads_per_rank(self.cores_shared_by or self.context.local_world_size)

    def use_torch_threads(self, configured: int | None) -> None:
        """Set torch's intra-op threads to `torch_threads(configured)` before this rank builds its model (never torch's
        all-cores default, which oversubscribes a machine shared by ranks)."""
        import torch

        torch.set_num_threads(self.torch_threads(configured))

    def use_rank_device(self) -> None:
        """Make this rank's GPU (index LOCAL_RANK among the visible ones) the calling thread's current device,
        once CUDA is initialized in this process (before that, selecting one would initialize CUDA ahead
        of `set_local_placement`'s CUDA_VISIBLE_DEVICES). No-op without GPUs."""
        if not self.context.use_gpu or "torch" not in sys.modules:
            return
        import torch

        if torch.cuda.is_initialized() and torch.cuda.current_device() != self.context.local_rank:
            torch.cuda.set_device(self.context.local_rank)

    def _export_rank_env(self) -> None:
        # torchrun's variable names: megatron, vLLM and torch.distributed helpers read them.
        c = self.context
        os.environ.update(
            RANK=str(c.rank), WORLD_SIZE=str(c.world_size), LOCAL_RANK=str(c.local_rank),
            LOCAL_WORLD_SIZE=str(c.local_world_size), GROUP_RANK=str(c.node_rank),
        )
        os.environ[RESTART_ENV] = str(c.restart)
        if "GLOO_SOCKET_IFNAME" not in os.environ:
            # gloo advertises each rank under the address its host name resolves to unless told an interface, and
            # many images map the host name to loopback (127.0.1.1): a rank on another node could not connect. The
            # interface of this node's Ray address reaches the other nodes (launch/ray_*.sh export it; a cluster
            # started otherwise, e.g. by KubeRay or a plain `ray start`, gets it here). A user's own value is kept.
            ifname = interface_of(ray.util.get_node_ip_address())
            if ifname is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = ifname

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def world_size(self) -> int:
        return self.context.world_size

    # --------------------------------------------------------------- called by WorkerGroup
    def ping(self) -> int:
        """Liveness probe; returns the rank."""
        return self.context.rank

    def placement(self) -> tuple[str, list[str], str]:
        """(Ray node id, accelerator ids Ray assigned to this actor, the node's address)."""
        gpu_ids = [str(i) for i in ray.get_gpu_ids()] if self.context.use_gpu else []
        return ray.get_runtime_context().get_node_id(), gpu_ids, ray.util.get_node_ip_address()

    def share_cores(self, ranks_by_machine: dict[str, int]) -> int:
        """Learn how many ranks run at once on this rank's machine, every pool counted (`ranks_by_machine`: Ray node
        id -> ranks): a disaggregated rollout pool on the trainer's machine generates while the trainer updates, so
        both share its cores. Returns the count (`cores_shared_by`)."""
        self.cores_shared_by = ranks_by_machine.get(ray.get_runtime_context().get_node_id(),
                                                    self.context.local_world_size)
        return self.cores_shared_by

    def set_local_placement(self, local_rank: int, local_world_size: int, visible_devices: list[str]) -> None:
        """Adopt the rank's position among the group's ranks on its physical node.

        On GPU, every rank of a node sees all of the node's group GPUs, in local-rank order, so
        device index == LOCAL_RANK as under torchrun (megatron and vLLM select devices that way).
        Must run before CUDA is initialized in this process.
        """
        self.context = replace(self.context, local_rank=local_rank, local_world_size=local_world_size)
        if visible_devices:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_devices)
        self._export_rank_env()

    def pick_master_address(self) -> tuple[str, int]:
        """This node's address and a port free on it right now (called on rank 0)."""
        address = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
            return address, sock.getsockname()[1]

    def init_process_group(self, master_addr: str, master_port: int, dist_backend: str, timeout_s: float) -> None:
        """Join the group's default process group; all ranks must call this concurrently.

        `timeout_s` (`trainer.nccl_timeout_s`) bounds every collective of the group, megatron's
        groups included (they take the world group's); a dead rank is caught sooner by the
        controller, which kills the whole group.
        """
        import torch
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        if dist_backend == "nccl":
            torch.cuda.set_device(self.context.local_rank)
        dist.init_process_group(
            backend=dist_backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.context.rank,
            world_size=self.context.world_size,
            timeout=timedelta(seconds=timeout_s),
        )

    def process_group_timeouts(self) -> dict[str, float | None]:
        """Seconds each of this rank's process groups waits in a collective: the world group's,
        and megatron's TP/PP/DP/CP groups once its parallel state is set up."""
        timeouts = {"world": state.process_group_timeout_s()}
        if state.is_initialized():
            ctx = state.get_context()
            for axis in ("tp", "pp", "dp", "cp", "dp_cp", "model_parallel"):
                timeouts[axis] = state.process_group_timeout_s(getattr(ctx, f"{axis}_group"))
        return timeouts

    def destroy_process_group(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ hook for subclasses
    def mesh_coords(self) -> MeshCoord:
        """This rank's mesh position. Default: pure data parallel (every rank its own DP index).

        Model-parallel workers override this after setting up megatron's parallel state.
        """
        return MeshCoord(dp=self.context.rank)
