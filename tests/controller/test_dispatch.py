"""Dispatch over a real 8-rank worker group (TP2 x PP2 x DP2, 0.25 CPU each) joined by gloo."""
from __future__ import annotations

import time

import numpy as np
import pytest
import ray
import torch

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
from hybridrl.data.batch import Batch
from tests.support.controller_workers import EchoWorker, FailingWorker

MESH_SIZES = {"tp": 2, "pp": 2, "dp": 2}


# ------------------------------------------------------------------------------ mesh (no Ray)
@pytest.mark.parametrize("sizes", [(2, 2, 2, 1), (2, 1, 2, 2), (1, 2, 4, 1), (4, 2, 1, 1), (2, 2, 1, 2)])
def test_from_sizes_matches_megatron_rank_generator(sizes):
    """Our coordinates agree with megatron-core 0.16.1's RankGenerator under its default order."""
    import inspect

    from megatron.core import parallel_state

    default_order = inspect.signature(parallel_state.initialize_model_parallel).parameters["order"].default
    assert default_order == "tp-cp-ep-dp-pp"
    tp, pp, dp, cp = sizes
    mesh = RankMesh.from_sizes(tp=tp, pp=pp, dp=dp, cp=cp)
    generator = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=default_order)
    for axis in ("tp", "pp", "dp", "cp"):
        for group in generator.get_ranks(axis):
            others = {tuple(getattr(mesh.coords[r], a) for a in ("tp", "pp", "dp", "cp") if a != axis)
                      for r in group}
            assert len(others) == 1, (axis, group)  # a group varies only along its own axis
            assert [getattr(mesh.coords[r], axis) for r in group] == list(range(len(group))), (axis, group)


def test_mesh_validation_and_output_ranks():
    mesh = RankMesh.from_sizes(**MESH_SIZES)
    assert mesh.world_size == 8 and mesh.dp_size == 2
    # tp fastest, then dp, pp slowest: rank = tp + 2*dp + 4*pp; outputs are pp=1, tp=0
    assert mesh.coords[5] == MeshCoord(dp=0, tp=1, pp=1)
    assert mesh.output_ranks() == [4, 6]
    assert mesh.ranks_of_dp(1) == [2, 3, 6, 7]
    # Plain per-rank coordinates (dicts or objects with attributes) give the same mesh.
    as_dicts = [{"dp": c.dp, "tp": c.tp, "pp": c.pp} for c in mesh.coords]
    assert RankMesh.from_coords(as_dicts) == mesh
    with pytest.raises(ValueError, match="same coordinates"):
        RankMesh.from_coords([MeshCoord(dp=0), MeshCoord(dp=0)])
    with pytest.raises(ValueError, match="missing"):
        RankMesh.from_coords([MeshCoord(dp=0), MeshCoord(dp=1, tp=1)])
    with pytest.raises(ValueError, match="leaves out"):
        RankMesh.from_sizes(tp=2, pp=2, order="tp-dp")


def test_call_builders():
    calls = all_to_all([(1,), RankCall((2,), {"k": 3})], world_size=2)
    assert calls == [RankCall((1,)), RankCall((2,), {"k": 3})]
    with pytest.raises(ValueError, match="arguments for 1 ranks, the group has 2"):
        all_to_all([(1,)], world_size=2)
    with pytest.raises(TypeError, match="rank 0"):
        all_to_all([1, 2], world_size=2)


def test_a_worker_call_names_a_method_of_the_group_class():
    from hybridrl.controller.worker_group import worker_method_name

    assert worker_method_name(EchoWorker, EchoWorker.scale, "actor") == "scale"
    assert worker_method_name(EchoWorker, EchoWorker.ping, "actor") == "ping"  # inherited from Worker
    # the same name on another worker class is another function: refused, naming both classes
    with pytest.raises(TypeError, match=r"FailingWorker\.pid is a method of FailingWorker, not of EchoWorker"):
        worker_method_name(EchoWorker, FailingWorker.pid, "actor")
    with pytest.raises(TypeError, match=r"actor group: pass the worker method itself \(EchoWorker\.scale\)"):
        worker_method_name(EchoWorker, "scale", "actor")
    with pytest.raises(TypeError, match="42 is not a method of EchoWorker"):
        worker_method_name(EchoWorker, 42, "actor")


def test_the_group_takes_a_plain_worker_class_only():
    """A `ray.remote` class would hide the methods calls are checked against: refused before any
    resource is reserved (no pool is even looked at)."""
    import ray

    from hybridrl.controller.worker_group import WorkerGroup

    for bad in (ray.remote(EchoWorker), object, EchoWorker.scale):
        with pytest.raises(TypeError, match="actor group: worker_cls must be a plain Worker subclass"):
            WorkerGroup(bad, None, name="actor")


# ------------------------------------------------------------------------- a real worker group
@pytest.fixture(scope="module")
def echo_group(ray_cluster):
    from hybridrl.controller.resource_pool import ResourcePool
    from hybridrl.controller.worker_group import WorkerGroup

    pool = ResourcePool("dispatch", nnodes=1, workers_per_node=8, cpus_per_worker=0.25).start(timeout_s=60)
    group = WorkerGroup(EchoWorker, pool, name="actor", worker_kwargs={"mesh_sizes": MESH_SIZES},
                        process_group_timeout_s=60)
    yield group
    group.shutdown()
    pool.shutdown()


def make_batch(rows: int) -> Batch:
    return Batch(
        {"x": torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)},
        {"uid": [f"u{i}" for i in range(rows)], "group": np.arange(rows) // 4},
        {"step": 7},
    )


def test_group_environment_and_gloo_all_reduce(echo_group):
    env = echo_group.call_all(EchoWorker.environment)
    assert [int(e["RANK"]) for e in env] == list(range(8))
    assert {e["WORLD_SIZE"] for e in env} == {"8"} and {e["backend"] for e in env} == {"gloo"}
    assert sorted(int(e["LOCAL_RANK"]) for e in env) == list(range(8))  # one node: local == global set
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in env}) == 1
    assert len(set(echo_group.call_all(EchoWorker.pid))) == 8
    sums = echo_group.call_per_rank(EchoWorker.all_reduce, [(float(r + 1),) for r in range(8)])
    assert sums == [36.0] * 8  # 1 + 2 + ... + 8 on every rank


def test_cpu_workers_keep_freed_memory_in_their_heap(echo_group):
    # DevicePolicy.worker_env on CPU: glibc must not hand big freed blocks back to the kernel, or
    # every step page-faults its logits and grads again. The workers' own allocator shows it.
    from hybridrl.parallel.device_policy import CPU

    assert echo_group.call_all(EchoWorker.env_of, [name for name, _ in CPU.worker_env])[0] == dict(CPU.worker_env)
    kept = echo_group.call_all(EchoWorker.resident_mib_after_freeing_a_64mib_tensor)
    assert min(kept) > 60, kept


def test_worker_env_keeps_the_users_own_values(monkeypatch):
    from hybridrl.controller.worker_group import worker_process_env
    from hybridrl.parallel.device_policy import CPU, CUDA

    monkeypatch.delenv("MALLOC_MMAP_MAX_", raising=False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "123")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setenv("PYTHONWARNINGS", "error")
    monkeypatch.setenv("TORCH_LOGS", "+dynamo")
    assert worker_process_env(CPU) == {"MALLOC_MMAP_MAX_": "0"}
    assert worker_process_env(CUDA) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    assert worker_process_env(CUDA) == {}


def test_the_group_refuses_a_foreign_method_before_calling_any_rank(echo_group):
    with pytest.raises(TypeError, match="not of EchoWorker"):
        echo_group.call_all(FailingWorker.pid)
    with pytest.raises(TypeError, match="not its name"):
        echo_group.call_by_dp("scale", make_batch(4), 2.0)
    assert echo_group.alive and len(echo_group.call_all(EchoWorker.pid)) == 8  # nothing was torn down


def test_learn_mesh_reads_worker_coordinates(echo_group):
    mesh = echo_group.learn_mesh()
    assert mesh == RankMesh.from_sizes(**MESH_SIZES)


def test_dispatch_by_dp_chunks_replicas_and_collect_order(echo_group):
    mesh = RankMesh.from_sizes(**MESH_SIZES)
    echo_group.set_mesh(mesh)
    batch = make_batch(16)
    refs = dispatch_by_dp(batch, mesh)
    assert len(refs) == 8 and len(set(refs)) == 2  # one object per DP chunk, shared by its peers
    results = echo_group.execute_all(EchoWorker.scale, [RankCall((ref, 10.0)) for ref in refs])

    received = echo_group.call_all(EchoWorker.last_received)
    expected_chunks = batch.split(2)
    for rank, got in enumerate(received):
        want = expected_chunks[mesh.coords[rank].dp]
        assert torch.equal(got["x"], want["x"]), rank
        assert list(got["uid"]) == list(want["uid"]), rank
        assert got.meta == {"step": 7}
    # Every rank read its chunk zero-copy from the object store.
    assert echo_group.call_all(EchoWorker.shared_keys_of_last) == [["x"]] * 8

    collected = collect_from_output_ranks(results, mesh)
    assert torch.equal(collected["y"], batch["x"] * 10.0)
    assert list(collected["uid"]) == list(batch["uid"])
    assert list(collected["produced_by"]) == [4] * 8 + [6] * 8  # last pp stage, tp 0, by dp
    assert [m.meta["rank"] for m in select_output_ranks(results, mesh)] == [4, 6]


def test_call_by_dp_pads_and_unpads(echo_group):
    echo_group.set_mesh(RankMesh.from_sizes(**MESH_SIZES))
    batch = make_batch(5)  # not divisible by dp=2: one padding row travels and is dropped
    out = echo_group.call_by_dp(EchoWorker.scale, batch, 2.0)
    assert len(out) == 5
    assert torch.equal(out["y"], batch["x"] * 2.0)
    assert list(out["uid"]) == list(batch["uid"])


def test_dispatch_follows_reported_coordinates_not_rank_order(ray_cluster, echo_group):
    """A mesh whose ranks are laid out differently (pp fastest) routes chunks by coordinates."""
    mesh = RankMesh.from_sizes(**MESH_SIZES, order="pp-tp-dp")
    echo_group.set_mesh(mesh)
    batch = make_batch(8)
    out = echo_group.call_by_dp(EchoWorker.scale, batch, 3.0)
    assert torch.equal(out["y"], batch["x"] * 3.0)
    owners = mesh.output_ranks()
    assert list(out["produced_by"]) == [owners[0]] * 4 + [owners[1]] * 4
    assert owners == [1, 5]  # rank = pp + 2*tp + 4*dp; pp=1, tp=0


def test_one_to_all_shares_bulky_arguments(ray_cluster):
    import ray

    batch = make_batch(4)
    calls = one_to_all(batch, 1.5, world_size=3, note="small")
    assert len(calls) == 3
    assert isinstance(calls[0].args[0], ray.ObjectRef) and calls[0].args[1] == 1.5
    assert calls[0].kwargs == {"note": "small"}
    assert len({c.args[0] for c in calls}) == 1  # put once, shared by every rank


def test_colocated_groups_share_a_pool(ray_cluster):
    """1 node x 2 bundles, two groups colocated: separate processes and process groups, rank r of each in bundle r."""
    from hybridrl.controller.resource_pool import ResourcePool, ResourcePoolError
    from hybridrl.controller.worker_group import WorkerGroup

    pool = ResourcePool("colocated", nnodes=1, workers_per_node=2, cpus_per_worker=0.5, max_colocated_groups=2)
    pool.start(timeout_s=60)
    try:
        actor = WorkerGroup(EchoWorker, pool, name="actor")
        critic = WorkerGroup(EchoWorker, pool, name="critic")
        with pytest.raises(ResourcePoolError, match="at most 2 colocated"):
            pool.reserve("reward")
        # Separate processes, separate process groups (different master ports), both working.
        assert set(actor.call_all(EchoWorker.pid)).isdisjoint(critic.call_all(EchoWorker.pid))
        assert actor.call_all(EchoWorker.all_reduce, 1.0) == [2.0, 2.0]
        assert critic.call_all(EchoWorker.all_reduce, 2.0) == [4.0, 4.0]
        environments = actor.call_all(EchoWorker.environment) + critic.call_all(EchoWorker.environment)
        ports = {e["MASTER_PORT"] for e in environments}
        assert len(ports) == 2
        # Rank r of both groups runs in bundle r of the node's placement group, each actor taking half a bundle.
        node_group = pool.placement_groups[0].id.hex()
        for group in (actor, critic):
            assert group.call_all(EchoWorker.placement_info) == [(node_group, {"CPU": 0.25})] * 2
            env = group.call_all(EchoWorker.environment)
            assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in env] == [
                ("0", "0", "2"), ("1", "1", "2")]
        actor.shutdown()
        critic.shutdown()
        assert pool.groups == []
    finally:
        pool.shutdown()


def test_a_pools_nodes_are_different_machines(ray_cluster):
    """Two node groups need two machines, even where one machine has room for both (this one has, at 0.25 CPU a
    bundle): on this one-machine cluster the pool is refused, naming the rule, and leaves nothing reserved. (Ray
    alone packed both onto one machine, so a `trainer.nnodes=2` job trained on one host; tests/e2e/test_multi_host.py
    checks the placement on real hosts.)"""
    from hybridrl.controller.resource_pool import ResourcePool, ResourcePoolError

    free = ray.available_resources().get("CPU", 0.0)
    assert free >= 0.5
    pool = ResourcePool("two_machines", nnodes=2, workers_per_node=1, cpus_per_worker=0.25)
    refused = r"1/2 node groups ready.*every node a different machine.*1 node\(s\) alive"
    with pytest.raises(ResourcePoolError, match=refused):
        pool.start(timeout_s=3)
    assert not pool.started
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0.0) < free and time.monotonic() < deadline:
        time.sleep(0.1)  # removing a placement group returns its resources asynchronously
    # (more where an earlier test's pool is still being returned)
    assert ray.available_resources().get("CPU", 0.0) >= free


def test_init_ray_connects_to_an_existing_cluster_named_by_ray_address(ray_cluster):
    """A second driver process joins the session's cluster through RAY_ADDRESS (multi-node path)."""
    import os
    import subprocess
    import sys

    script = (
        "from hybridrl.controller.cluster import init_ray\n"
        "cluster = init_ray()\n"
        "import ray\n"
        "assert not cluster.started_here and cluster.temp_dir is None\n"
        "print('cpus', ray.cluster_resources()['CPU'], 'answer', ray.get(ray.remote(lambda: 42).remote()))\n"
        "cluster.shutdown()\n"
    )
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.address)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"cpus {float(ray_cluster.resources()['CPU'])} answer 42" in done.stdout
