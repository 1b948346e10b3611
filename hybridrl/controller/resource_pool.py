"""Resource pools: placement groups reserving the slots that worker groups run in.

A pool is `nnodes` placement groups (one per node, packed onto one machine, each on a machine of
its own) of `workers_per_node` bundles each: `{"GPU": 1, "CPU": c}` on GPU clusters, `{"CPU": c}` on CPU
(Ray rejects empty bundles, so c > 0; fractions such as 0.25 let 8 ranks share 2 cores in tests).
Global rank r lives in bundle r % workers_per_node of node r // workers_per_node.

Distinct machines. `nnodes` means machines: the plan's traffic, the node-local ranks and the
intra-node links all assume it. Ray alone would pack two node groups onto one machine whenever it
has room for both (it did, on CPU hosts), so each node group is placed in turn with a label
selector that excludes the machines the earlier ones took (greedy: Ray picks the machine, we only
rule out the used ones).

Colocation. Several worker groups may share one pool: each group places one actor per
bundle, and every actor takes 1/max_colocated_groups of its bundle, so the groups' rank r run on
the same GPU. (The colocated policy - actor, rollout and reference in the *same processes* - is one
worker group whose worker class plays all three roles; pools colocate separate processes, e.g. a
critic next to the actor.)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import (
    NODE_ID_LABEL_KEY,
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from hybridrl.controller.cluster import gcs_answers
from hybridrl.parallel.device_policy import CPU, DevicePolicy


class ResourcePoolError(RuntimeError):
    """The pool could not be placed, or a group asked for more than the pool offers."""


@dataclass(frozen=True)
class ActorResources:
    """What one actor of a colocated group asks Ray for, inside its bundle."""

    num_cpus: float
    num_gpus: float


@dataclass
class ResourcePool:
    name: str
    nnodes: int = 1
    workers_per_node: int = 1
    # the run's device policy: whether bundles hold a GPU, and the groups' torch.distributed backend
    device_policy: DevicePolicy = CPU
    cpus_per_worker: float = 1.0
    max_colocated_groups: int = 1
    placement_groups: list[PlacementGroup] = field(default_factory=list, init=False)
    machines: list[str] = field(default_factory=list, init=False)  # the Ray node id of each node group, once started
    groups: list[str] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.nnodes <= 0 or self.workers_per_node <= 0:
            raise ValueError(f"pool {self.name!r}: nnodes and workers_per_node must be positive")
        if self.cpus_per_worker <= 0:
            raise ValueError(
                f"pool {self.name!r}: cpus_per_worker must be > 0 (Ray rejects bundles without resources)"
            )
        if self.max_colocated_groups <= 0:
            raise ValueError(f"pool {self.name!r}: max_colocated_groups must be positive")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.workers_per_node

    @property
    def use_gpu(self) -> bool:
        """Each bundle holds one GPU (and each worker is pinned to its bundle's GPU)."""
        return self.device_policy.ray_use_gpu

    @property
    def bundle(self) -> dict[str, float]:
        bundle = {"CPU": float(self.cpus_per_worker)}
        if self.use_gpu:
            bundle["GPU"] = 1.0
        return bundle

    @property
    def started(self) -> bool:
        return bool(self.placement_groups)

    def _describe_request(self) -> str:
        total = {k: v * self.world_size for k, v in self.bundle.items()}
        return (
            f"{self.nnodes} node(s) x {self.workers_per_node} bundles of {self.bundle} "
            f"(each node's bundles on one machine, every node a different machine; {total} in all)"
        )

    def start(self, timeout_s: float = 60.0, poll_s: float = 1.0) -> ResourcePool:
        """Create the placement groups and wait until Ray has reserved them.

        Raises ResourcePoolError naming the request and the cluster's resources when they are not
        all ready within `timeout_s` (the pending groups are removed, so nothing stays queued).
        """
        if self.started:
            return self
        groups: list[PlacementGroup] = []
        machines: list[str] = []  # Ray node ids the node groups placed so far took
        deadline = time.monotonic() + timeout_s
        for _ in range(self.nnodes):
            groups.append(self._place_node_group(machines))
            while not ray.wait([groups[-1].ready()], timeout=max(0.0, min(poll_s, deadline - time.monotonic())))[0]:
                if time.monotonic() >= deadline:
                    for g in groups:
                        remove_placement_group(g)
                    raise ResourcePoolError(self._not_placed(timeout_s, len(groups) - 1))
            machines.append(placement_group_table(groups[-1])["bundles_to_node_id"][0])
        self.placement_groups = groups
        self.machines = machines
        return self

    def ranks_by_machine(self) -> dict[str, int]:
        """The ranks (bundles) of each group of this pool on each Ray node it was placed on."""
        return {machine: self.workers_per_node for machine in self.machines}

    def _place_node_group(self, taken: list[str]) -> PlacementGroup:
        """One node's bundles packed on one machine that is none of `taken`."""
        bundles = [dict(self.bundle) for _ in range(self.workers_per_node)]
        elsewhere = [{NODE_ID_LABEL_KEY: f"!in({','.join(taken)})"} for _ in bundles] if taken else None
        return placement_group(bundles, strategy="STRICT_PACK", bundle_label_selector=elsewhere)

    def _not_placed(self, timeout_s: float, ready: int) -> str:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        alive = "; ".join(f"{n['NodeManagerAddress']} {_schedulable(n['Resources'])}" for n in nodes)
        return (f"resource pool {self.name!r} could not be placed within {timeout_s} s: "
                f"{ready}/{self.nnodes} node groups ready. Requested {self._describe_request()}. "
                f"Cluster total {_schedulable(ray.cluster_resources())}, free now "
                f"{_schedulable(ray.available_resources())}; {len(nodes)} node(s) alive: {alive}.")

    def reserve(self, group: str) -> ActorResources:
        """Admit one more colocated worker group; returns what each of its actors should request."""
        if not self.started:
            raise ResourcePoolError(f"resource pool {self.name!r} is not started; call start() first")
        if len(self.groups) >= self.max_colocated_groups:
            raise ResourcePoolError(
                f"resource pool {self.name!r} hosts at most {self.max_colocated_groups} colocated worker "
                f"group(s), already {self.groups}; cannot add {group!r} (raise max_colocated_groups)"
            )
        self.groups.append(group)
        share = 1.0 / self.max_colocated_groups
        return ActorResources(num_cpus=self.cpus_per_worker * share, num_gpus=share if self.use_gpu else 0.0)

    def release(self, group: str) -> None:
        if group in self.groups:
            self.groups.remove(group)

    def locate(self, rank: int) -> tuple[PlacementGroup, int]:
        """(placement group, bundle index) of global rank `rank`."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside pool {self.name!r} of {self.world_size} workers")
        node, bundle = divmod(rank, self.workers_per_node)
        return self.placement_groups[node], bundle

    def shutdown(self) -> None:
        """Remove the placement groups (actors still running in them are killed by Ray)."""
        if self.placement_groups and not gcs_answers():
            # The cluster went down under the run (SLURM's scancel sends SIGTERM to every process of the job, Ray's
            # GCS too): the groups went with it, and asking it to remove them would block for Ray's 60 s GCS
            # reconnect timeout, after which Ray ends the process itself, with no word from the trainer.
            self.placement_groups = []
        for group in self.placement_groups:
            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001 - already removed, or Ray is shutting down
                pass
        self.placement_groups = []
        self.groups = []


def _schedulable(resources: dict[str, float]) -> dict[str, float]:
    """What a bundle can ask for (CPU, GPU, custom resources), without Ray's bookkeeping: memory, the `node:<ip>`
    markers and the per-placement-group resources (`CPU_group_<id>`, `bundle_group_<id>`)."""
    hidden = ("memory", "object_store_memory")
    return {name: value for name, value in sorted(resources.items())
            if name not in hidden and not name.startswith("node:") and "_group_" not in name}
