"""Every worker method runs with the rank's GPU as the current CUDA device, whatever thread Ray runs it on.

CUDA's current device belongs to the calling thread. On this CPU-only machine no CUDA context exists, so
torch.cuda's device calls are replaced in this test by a per-thread record of the device a thread selected
(what the CUDA runtime keeps): the stand-in for the one part that cannot exist here.
"""
from __future__ import annotations

import gc
import threading

import pytest

from hybridrl.controller.base_worker import RankContext, Worker
from hybridrl.workers.colocated import ColocatedPolicyWorker
from hybridrl.workers.critic import CriticWorker
from hybridrl.workers.frozen_roles import RewardModelWorker
from hybridrl.workers.policy import DisaggregatedPolicyWorker
from hybridrl.workers.rollout_worker import RolloutWorker


@pytest.fixture
def cuda_threads(monkeypatch):
    import torch

    current = threading.local()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(current, "device", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: setattr(current, "device", index))
    return current


class _Probe(Worker):
    def seen_device(self) -> int:
        import torch

        return torch.cuda.current_device()


def test_a_method_called_on_another_thread_runs_on_the_ranks_gpu(cuda_threads):
    worker = _Probe(RankContext(group="x", rank=5, world_size=8, node_rank=0, local_rank=5, local_world_size=8,
                                use_gpu=True))
    assert worker.seen_device() == 5
    seen = []
    thread = threading.Thread(target=lambda: seen.append(worker.seen_device()))  # a fresh thread: device 0
    thread.start()
    thread.join()
    assert seen == [5]
    cpu = _Probe(RankContext(group="x", rank=5, world_size=8, node_rank=0, local_rank=5, local_world_size=8,
                             use_gpu=False))
    other = []
    thread = threading.Thread(target=lambda: other.append(cpu.seen_device()))
    thread.start()
    thread.join()
    assert other == [0]  # no GPU: nothing selected


@pytest.mark.parametrize("worker_cls", [ColocatedPolicyWorker, DisaggregatedPolicyWorker, RolloutWorker, CriticWorker,
                                        RewardModelWorker])
def test_every_public_method_of_the_role_workers_selects_the_device(worker_cls):
    public = [name for name in dir(worker_cls) if not name.startswith("_") and callable(getattr(worker_cls, name))
              and name not in vars(Worker)]
    assert public and all(getattr(getattr(worker_cls, name), "on_rank_device", False) for name in public), \
        [n for n in public if not getattr(getattr(worker_cls, n), "on_rank_device", False)]


class _Cycle:
    def __init__(self) -> None:
        self.me = self


class _Building(Worker):
    """Records whether Python's automatic collection ran in each call."""

    def setup(self) -> list[bool]:
        import weakref

        seen = [gc.isenabled()]
        self.init_model()  # a bring-up inside another
        seen.append(gc.isenabled())
        self.garbage = weakref.ref(_Cycle())  # a cycle, garbage at once: only a collection frees it
        self.kept = _Cycle()
        return seen

    def init_model(self) -> bool:
        return gc.isenabled()

    def step(self) -> bool:
        return gc.isenabled()


def test_a_workers_bring_up_runs_without_automatic_collections_and_freezes_what_it_built():
    """`setup` / `init_model` (the calls that import megatron and vLLM and build the model and the engine) run with
    Python's automatic collection paused; after them one collection frees their garbage and what is alive is frozen,
    skipped by every later collection; other calls run with collection on."""
    worker = _Building(RankContext(group="x", rank=0, world_size=1, node_rank=0, local_rank=0, local_world_size=1,
                                   use_gpu=False))
    assert gc.isenabled()
    try:
        assert worker.setup() == [False, False]
        assert gc.isenabled() and worker.step()
        assert worker.garbage() is None  # collected before the freeze, not frozen with the rest
        assert gc.get_freeze_count() > 0 and not any(o is worker.kept for o in gc.get_objects())  # frozen: untracked
        assert worker.init_model() is False and gc.isenabled()  # a bring-up called alone: paused in it, on after
    finally:
        gc.unfreeze()
