"""Worker classes for the controller tests (a module under tests/, importable by Ray workers)."""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from hybridrl.controller.base_worker import RankContext, Worker
from hybridrl.controller.dispatch import MEGATRON_DEFAULT_ORDER, MeshCoord, RankMesh
from hybridrl.data.batch import Batch


class EchoWorker(Worker):
    """Transforms the chunk it receives and remembers it, so tests can see what each rank got."""

    def __init__(
        self,
        context: RankContext,
        mesh_sizes: dict[str, int] | None = None,
        order: str = MEGATRON_DEFAULT_ORDER,
    ):
        super().__init__(context)
        torch.set_num_threads(1)
        self.received: Batch | None = None
        # The coordinates this rank reports, as a megatron worker would after its parallel setup.
        self.mesh = RankMesh.from_sizes(**mesh_sizes, order=order) if mesh_sizes else None

    def mesh_coords(self) -> MeshCoord:
        return self.mesh.coords[self.rank] if self.mesh else super().mesh_coords()

    def scale(self, batch: Batch, factor: float) -> Batch:
        self.received = batch
        return Batch(
            {"y": batch["x"] * factor},
            {"uid": batch["uid"], "produced_by": [self.rank] * len(batch)},
            {"rank": self.rank},
        )

    def last_received(self) -> Batch:
        return self.received

    def shared_keys_of_last(self) -> list[str]:
        return sorted(self.received.shared_keys)

    def all_reduce(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor)
        return tensor.item()

    def environment(self) -> dict[str, str]:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        return {k: os.environ.get(k, "") for k in keys} | {"backend": dist.get_backend()}

    def pid(self) -> int:
        return os.getpid()

    def env_of(self, names: list[str]) -> dict[str, str | None]:
        return {name: os.environ.get(name) for name in names}

    def resident_mib_after_freeing_a_64mib_tensor(self) -> float:
        """How much of a freed 64 MiB tensor stays resident: ~64 when glibc keeps freed memory in its
        heap (no mmap'ed blocks, no trimming), ~0 when it returns the block to the kernel."""
        def resident_mib() -> float:
            with open("/proc/self/statm") as statm:
                return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

        tensor = torch.ones(16 * 2**20)  # written: every page resident
        held = resident_mib()
        del tensor
        return 64.0 - (held - resident_mib())

    def placement_info(self) -> tuple[str, dict[str, float]]:
        """(id of the placement group this actor runs in, the resources it was assigned)."""
        import ray

        group = ray.util.get_current_placement_group()
        return group.id.hex() if group else "", dict(ray.get_runtime_context().get_assigned_resources())


class FailingWorker(Worker):
    """Every rank but one enters an all_reduce; that one fails in the requested way."""

    def __init__(self, context: RankContext, fail_in_constructor: bool = False):
        super().__init__(context)
        if fail_in_constructor and context.rank == 1:
            raise RuntimeError("constructor failure on purpose")

    def collective_or_fail(self, fail_rank: int, how: str, delay_s: float) -> float:
        if self.rank == fail_rank:
            # Give the peers time to enter the collective, so they are blocked in it when we fail.
            time.sleep(delay_s)
            if how == "raise":
                raise ValueError(f"deliberate failure on rank {self.rank}")
            if how == "exit":
                os._exit(3)
            if how == "sleep":  # the controller kills us from outside
                time.sleep(3600)
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        return tensor.item()

    def pid(self) -> int:
        return os.getpid()
