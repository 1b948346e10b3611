"""Fail fast: a failing or dead rank surfaces at the controller in seconds while its peers are blocked
in a gloo collective; the group is torn down; placement that cannot fit fails within its timeout."""
from __future__ import annotations

import threading
import time

import pytest

from hybridrl.controller.gather import PEER_LOST, WorkerGroupError
from hybridrl.controller.resource_pool import ResourcePool, ResourcePoolError
from hybridrl.controller.worker_group import WorkerGroup, WorkerGroupClosedError
from tests.support.controller_workers import FailingWorker

WORLD = 3
FAIL_RANK = 2
# The peers' process-group timeout is far longer than what we allow the controller: the error
# must come from the fail-fast gather, not from gloo timing out.
PG_TIMEOUT_S = 120.0
SURFACE_LIMIT_S = 30.0


@pytest.fixture
def pool(ray_cluster):
    pool = ResourcePool("failures", workers_per_node=WORLD, cpus_per_worker=0.25).start(timeout_s=60)
    yield pool
    pool.shutdown()


def make_group(pool: ResourcePool) -> WorkerGroup:

    group = WorkerGroup(FailingWorker, pool, name="actor", process_group_timeout_s=PG_TIMEOUT_S)
    # The group works before we break it.
    assert group.call_all(FailingWorker.collective_or_fail, -1, "none", 0.0) == [float(WORLD)] * WORLD
    return group


def assert_peers_were_in_the_collective(error: WorkerGroupError) -> None:
    """Every other rank was still blocked in all_reduce, or its all_reduce broke because the failed
    rank vanished (gloo notices a dead peer at once) - and the culprit is reported first."""
    symptoms = {f.rank for f in error.failures if f.kind == PEER_LOST}
    assert [f.rank for f in error.failures if f.kind != PEER_LOST] == [FAIL_RANK]
    assert sorted(set(error.unfinished_ranks) | symptoms) == [r for r in range(WORLD) if r != FAIL_RANK]


def assert_torn_down(group: WorkerGroup, pids: list[int]) -> None:
    import ray

    assert not group.alive
    with pytest.raises(WorkerGroupClosedError, match="actor worker group is shut down after a failure"):
        group.call_all(FailingWorker.pid)
    # ray.kill is asynchronous: a call sent right after it may still be served before the kill
    # lands. Every actor must be dead within 30 s of the shutdown.
    deadline = time.monotonic() + 30
    for actor in group.actors:
        while True:
            try:
                ray.get(actor.pid.remote(), timeout=30)
            except ray.exceptions.RayActorError:
                break
            assert time.monotonic() < deadline, "an actor still answers 30 s after the group's shutdown"
            time.sleep(0.2)


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_failure_inside_rank_surfaces_with_role_rank_and_traceback(pool, how):
    group = make_group(pool)
    pids = group.call_all(FailingWorker.pid)
    start = time.monotonic()
    with pytest.raises(WorkerGroupError) as info:
        group.call_all(FailingWorker.collective_or_fail, FAIL_RANK, how, 1.0)
    elapsed = time.monotonic() - start
    error = info.value
    assert elapsed < SURFACE_LIMIT_S, elapsed
    assert error.group == "actor" and error.rank == FAIL_RANK and error.method == "collective_or_fail"
    assert_peers_were_in_the_collective(error)
    message = str(error)
    assert f"actor rank {FAIL_RANK} failed in collective_or_fail()" in message
    if how == "raise":
        assert error.failures[0].kind == "exception"
        # the first line names the cause itself, not only that there was one
        assert message.splitlines()[0].endswith("failed in collective_or_fail(): ValueError: deliberate failure "
                                                "on rank 2"), message.splitlines()[0]
        assert "deliberate failure on rank 2" in error.remote_traceback
        assert "controller_workers.py" in error.remote_traceback  # the remote traceback, not ours
    else:
        assert error.failures[0].kind == "actor died"
    assert pool.groups == []  # the slot is free again
    assert_torn_down(group, pids)
    print(f"{how}: surfaced after {elapsed:.2f} s")


def test_actor_killed_from_outside_mid_call(pool):
    import ray

    group = make_group(pool)
    pids = group.call_all(FailingWorker.pid)
    victim = group.actors[FAIL_RANK]
    killer = threading.Timer(1.5, lambda: ray.kill(victim, no_restart=True))
    start = time.monotonic()
    killer.start()
    try:
        with pytest.raises(WorkerGroupError) as info:
            group.call_all(FailingWorker.collective_or_fail, FAIL_RANK, "sleep", 0.0)
    finally:
        killer.cancel()
    elapsed = time.monotonic() - start
    assert elapsed < SURFACE_LIMIT_S, elapsed
    assert info.value.rank == FAIL_RANK and info.value.failures[0].kind == "actor died"
    assert "killed by `ray.kill`" in info.value.remote_traceback
    assert_peers_were_in_the_collective(info.value)
    assert_torn_down(group, pids)
    print(f"ray.kill: surfaced after {elapsed:.2f} s")


def test_constructor_failure_surfaces_at_group_creation(pool):

    start = time.monotonic()
    with pytest.raises(WorkerGroupError) as info:
        WorkerGroup(FailingWorker, pool, name="critic", worker_kwargs={"fail_in_constructor": True})
    assert time.monotonic() - start < SURFACE_LIMIT_S
    assert info.value.rank == 1 and info.value.method == "placement"
    assert "constructor failure on purpose" in str(info.value)
    assert pool.groups == []


def test_call_timeout_names_unfinished_ranks(pool):
    group = make_group(pool)
    group.call_timeout_s = 2.0
    start = time.monotonic()
    with pytest.raises(WorkerGroupError, match=r"did not finish collective_or_fail\(\) within 2.0 s") as info:
        # Rank 2 sleeps for an hour without failing: only the timeout can end this.
        group.call_all(FailingWorker.collective_or_fail, FAIL_RANK, "sleep", 0.0)
    assert time.monotonic() - start < 10.0
    assert info.value.unfinished_ranks == [0, 1, 2] and info.value.rank is None
    assert not group.alive


def test_placement_group_that_cannot_fit_fails_within_its_timeout(ray_cluster):
    import ray

    pool = ResourcePool("too_big", workers_per_node=2, cpus_per_worker=1000.0)
    start = time.monotonic()
    with pytest.raises(ResourcePoolError) as info:
        pool.start(timeout_s=2.0)
    elapsed = time.monotonic() - start
    assert 2.0 <= elapsed < 8.0, elapsed
    message = str(info.value)
    assert "'too_big' could not be placed within 2.0 s" in message
    assert "{'CPU': 1000.0}" in message and "Cluster total {'CPU': " in message
    assert "node(s) alive: " in message and "_group_" not in message and "memory" not in message
    assert not pool.started
    # The pending placement group was removed, not left queued in the cluster.
    states = [g["state"] for g in ray.util.placement_group_table().values()]
    assert "PENDING" not in states


def test_a_failure_names_the_node_of_each_failed_rank_on_many_nodes():
    from hybridrl.controller.gather import ACTOR_DIED, PEER_LOST, RankFailure, WorkerGroupError

    error = WorkerGroupError("actor", "update", [RankFailure(2, ACTOR_DIED, "raylet gone"),
                                                 RankFailure(0, PEER_LOST, "Connection closed by peer")], [1, 3], True)
    error.locate(["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"])
    lines = str(error).splitlines()
    assert lines[0] == "actor rank 2 failed in update(): actor died"
    assert lines[1] == ("where: rank 2 on node 10.0.0.2 (actor died); rank 0 on node 10.0.0.1 (collective failed "
                        "(a peer is gone)); an actor died on node 10.0.0.2 (it held actor ranks [2, 3]): killed (out "
                        "of memory?), or the host was lost or cut off")
    assert lines[2] == "also failed at the same time: ranks [0]"
    one_node = WorkerGroupError("actor", "update", [RankFailure(0, ACTOR_DIED, "x")], [], True)
    before = str(one_node)
    one_node.locate(["127.0.0.1", "127.0.0.1"])
    assert str(one_node) == before  # one node: nothing to locate
