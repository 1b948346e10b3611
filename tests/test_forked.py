import pytest
import torch  # noqa: F401  (the ranks use it; imported here so the parent pays once)

from hybridrl.parallel.forked import RankError, run_ranks


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

    from hybridrl.parallel import forked

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        monkeypatch.setattr(forked, "free_port", lambda: squatter.getsockname()[1])
        assert run_ranks(_all_reduce_rank, 2, 1.0, timeout_s=60) == [3.0, 3.0]
