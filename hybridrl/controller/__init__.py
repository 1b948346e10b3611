"""Ray single controller: resource pools, worker groups, explicit dispatch, fail-fast gathering.

Import order matters for local clusters: `cluster` sets the variable that makes Ray bind to
loopback before anything here imports ray.
"""
from hybridrl.controller.cluster import RayCluster, init_ray  # noqa: I001  (must import ray first)
from hybridrl.controller.base_worker import RankContext, Worker
from hybridrl.controller.dispatch import (
    MeshCoord,
    RankCall,
    RankMesh,
    all_to_all,
    collect_from_output_ranks,
    dispatch_by_dp,
    one_to_all,
    select_output_ranks,
)
from hybridrl.controller.gather import RankFailure, WorkerGroupError, execute_all
from hybridrl.controller.resource_pool import ActorResources, ResourcePool, ResourcePoolError
from hybridrl.controller.worker_group import WorkerGroup, WorkerGroupClosedError

__all__ = [
    "ActorResources", "MeshCoord", "RankCall", "RankContext", "RankFailure", "RankMesh", "RayCluster",
    "ResourcePool", "ResourcePoolError", "Worker", "WorkerGroup", "WorkerGroupClosedError",
    "WorkerGroupError", "all_to_all", "collect_from_output_ranks", "dispatch_by_dp", "execute_all",
    "init_ray", "one_to_all", "select_output_ranks",
]
