import pytest
import torch  # noqa: F401  (the ranks use it; imported here so the parent pays once)

from tests.support.forked import RankError, run_ranks


def _all_reduce_rank(rank: int, world_size: int, scale: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1) * scale])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def test_run_ranks_all_reduce():
    out = run_ranks(_all_reduce_rank, 3, 2.0, timeout_s=60)
    assert out == [12.0, 12.0, 12.0]  # 2 * (1 + 2 + 3)


def test_run_ranks_reports_failing_rank_with_traceback():
    with pytest.raises(RankError) as info:
        run_ranks(_fail_on_rank_one, 2, timeout_s=60)
    assert info.value.rank == 1
    assert "boom on purpose" in info.value.detail


def test_rendezvous_survives_a_port_taken_by_another_process(monkeypatch):
    """Concurrent runs (pytest -n 2) once collided: a port picked free and bound later by rank 0 was
    taken in between. The rendezvous port is now held by the parent from the start; a stale pick from
    `free_port` (here: a port already bound by someone else) must not matter."""
    import socket

    from tests.support import forked

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        monkeypatch.setattr(forked, "free_port", lambda: squatter.getsockname()[1])
        assert run_ranks(_all_reduce_rank, 2, 1.0, timeout_s=60) == [3.0, 3.0]


def _preloaded(rank: int, world_size: int, modules: list[str]) -> dict[str, bool]:
    import sys

    return {name: name in sys.modules for name in modules}


def test_the_session_rank_server_preloads_vllm_once_and_keeps_its_preload():
    """tests/conftest.py chose the server's preload: the ranks start with vLLM's engine modules already
    imported (each test's ranks would pay ~8 s otherwise), and no later call can change it."""
    from tests.support import forked

    modules = [*forked.VLLM_PRELOAD, "megatron.core", "hybridrl.workers.colocated"]
    absent = ["transformer_engine", "vllm.v1.worker.cpu_worker"]  # its import patches torch.cuda.Stream
    assert run_ranks(_preloaded, 1, modules + absent) == [{**dict.fromkeys(modules, True),
                                                           **dict.fromkeys(absent, False)}]
    with pytest.raises(RuntimeError, match=r"the rank server already runs with preload .* must come before"):
        forked.set_server_preload(("torch",))
    forked.set_server_preload(forked._server_preload)  # the same choice again is no change


def _heap_counts(rank: int, world_size: int) -> tuple[int, int]:
    import gc

    return gc.get_freeze_count(), len(gc.get_objects())


def test_the_ranks_start_with_the_servers_preloaded_heap_frozen():
    """The rank server froze what it preloaded (tests/support/frozen_heap.py): a rank's full collections skip it
    (vLLM's engine build runs three, 0.4 s each over this heap). Without the frozen module in the server's preload
    a rank starts with nothing frozen and ~660k objects to visit."""
    frozen, tracked = run_ranks(_heap_counts, 1)[0]
    assert frozen > 300_000 and tracked < frozen / 10, (frozen, tracked)


def _fail_then_peer_loses(rank: int, world_size: int) -> int:
    """Rank 0 fails on its own; rank 1 reports first with what gloo says when its peer is gone."""
    import time

    if rank == 0:
        time.sleep(0.5)
        raise ValueError("the cause, on rank 0")
    raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4274")


def test_the_cause_comes_first_even_when_a_peers_loss_arrives_before_it():
    """CI once failed on a race: the failing rank's report arrived after its peer's "Connection closed by
    peer", and only the latter was raised. Every failure is now gathered, the cause first."""
    with pytest.raises(RankError) as info:
        run_ranks(_fail_then_peer_loses, 2, timeout_s=60)
    assert info.value.rank == 0
    detail = info.value.detail
    assert "the cause, on rank 0" in detail and "Connection closed by peer" in detail
    assert detail.index("the cause, on rank 0") < detail.index("Connection closed by peer")


def test_the_longest_modules_are_scheduled_first(request):
    """tests/conftest.py puts the whole-run modules first so that the last minutes of a parallel run are not one
    worker alone on a long run: each named module exists (a moved file would silently lose its place), and in this
    session's collection every test of theirs comes before any other test."""
    from pathlib import Path

    from tests.conftest import LONGEST_FIRST, REPO_ROOT

    assert all((REPO_ROOT / name).is_file() for name in LONGEST_FIRST), LONGEST_FIRST
    ranks = [Path(item.path).relative_to(REPO_ROOT).as_posix() in LONGEST_FIRST for item in request.session.items]
    first_other = ranks.index(False) if False in ranks else len(ranks)
    assert not any(ranks[first_other:]), "a long-run module's test collected after other tests"
