"""Shared pytest fixtures.

`ray_cluster`: ONE private local Ray cluster for the whole session, started only when a test asks
for it (tests that don't need Ray never pay its 3-8 s start). Every module that needs Ray uses this
fixture instead of calling ray.init itself. The cluster binds to loopback, has token auth off, a
private temp dir, and PYTHONPATH holding the repository root so worker processes can import
actor classes defined under `tests/` (which is a package for that reason).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# Ray decides at import time whether a local cluster binds to loopback: set it before any test
# module imports ray.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

REPO_ROOT = Path(__file__).resolve().parent.parent

# Logical CPUs of the test cluster. The machine may have only 2 cores: tests ask for fractional
# bundles (e.g. 8 ranks x 0.25 CPU) and several groups can coexist.
TEST_CLUSTER_CPUS = 8


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[object]:
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
