"""A Ray address that names no cluster is refused within seconds, naming the field and the value.

`ray.init(address=...)` alone retries "Failed to connect to GCS" for many minutes on an unresolvable host or a
closed port, in native code a SIGTERM does not interrupt. `hybridrl train` and `init_ray` check the address first
(`cluster.check_ray_address`): the host resolved, a TCP connection, a gRPC reply. Real sockets, no mocks; the
test that a real cluster passes is test_dispatch's `test_init_ray_connects_to_an_existing_cluster_named_by_ray_address`
(init_ray runs the same check before it connects).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridrl.controller.cluster import RayAddressError, check_ray_address
from tools.demo_assets import demo_overrides

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs/examples/cpu_tiny_grpo.yaml")


def _closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _train(assets: Path, run: Path, env: dict[str, str], *overrides: str) -> subprocess.CompletedProcess[str]:
    """`hybridrl train` on the demo job (its run and checkpoint folders under `run`), as a user runs it."""
    return subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", CONFIG, *demo_overrides(assets, run),
                           *overrides, "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)


@pytest.fixture()
def silent_port() -> Iterator[int]:
    """A local port that accepts connections and never answers (a firewall's tarpit, or some other service)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("where", ["unresolvable host", "closed port"])
def test_train_refuses_an_unreachable_ray_address_fast_naming_it(demo_assets, tmp_path, where):
    address = "bogus.invalid:1234" if where == "unresolvable host" else f"127.0.0.1:{_closed_port()}"
    reason = "the host bogus.invalid does not resolve" if where == "unresolvable host" else \
        "refused the connection: nothing listens on port"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    started = time.monotonic()
    done = _train(demo_assets, tmp_path, env, f"trainer.ray_address={address}")
    elapsed = time.monotonic() - started
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"hybridrl train: trainer.ray_address={address} cannot be reached: " in done.stderr
    assert reason in done.stderr and "valid: HOST:PORT of a running Ray head" in done.stderr
    assert "Traceback" not in done.stderr and "Failed to connect to GCS" not in done.stderr
    assert elapsed < 45, elapsed  # python start, the plan and the stack check included; ray.init took minutes
    assert list(tmp_path.iterdir()) == []  # no run folder, no checkpoint folder: refused before the trainer


def test_ray_address_from_the_environment_is_named_as_such(demo_assets, tmp_path):
    done = _train(demo_assets, tmp_path, {**os.environ, "RAY_ADDRESS": "bogus.invalid:6379"})
    assert done.returncode == 2 and "hybridrl train: RAY_ADDRESS=bogus.invalid:6379 cannot be reached" in done.stderr


@pytest.mark.parametrize("overrides, field", [
    (["trainer.nnodes=2", "trainer.n_gpus_per_node=1"], "trainer.nnodes=2"),
    (["trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.mode=disaggregated", "actor_rollout_ref.rollout.nnodes=2",
      "actor_rollout_ref.rollout.n_gpus_per_node=1"], "actor_rollout_ref.rollout.nnodes=2"),
])
def test_a_job_of_several_machines_without_a_cluster_is_refused_before_ray_starts(demo_assets, tmp_path, overrides,
                                                                                   field):
    """No RAY_ADDRESS (the commonest slip of a multi-node job: train run on the login node, or the variable not
    exported): train started a Ray cluster of this machine alone and its pool waited 300 s for machines that could
    never join it, then failed naming resources. Refused at once, naming the field and the way to a cluster."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    started = time.monotonic()
    done = _train(demo_assets, tmp_path, env, *overrides)
    assert done.returncode == 2, done.stderr[-3000:]
    assert (f"hybridrl train: {field} needs a Ray cluster of 2 machines, but neither trainer.ray_address nor "
            "RAY_ADDRESS names one, so this run would start a Ray cluster of this machine alone") in done.stderr
    assert "launch/ray_head.sh" in done.stderr and "Traceback" not in done.stderr
    assert "Started a local Ray" not in done.stdout + done.stderr and time.monotonic() - started < 45
    assert list(tmp_path.iterdir()) == []  # no run folder: refused before the trainer
    local = _train(demo_assets, tmp_path, env, *overrides, "trainer.ray_address=local")
    assert local.returncode == 2 and f"{field} needs a Ray cluster of 2 machines, but trainer.ray_address=local " \
        "starts a Ray cluster of this machine alone" in local.stderr


def test_a_port_that_never_answers_is_refused_within_the_time_limit(silent_port):
    started = time.monotonic()
    with pytest.raises(RayAddressError, match=f"x=127.0.0.1:{silent_port} accepts a connection on port {silent_port} "
                                              "but does not answer as a Ray cluster"):
        check_ray_address(f"127.0.0.1:{silent_port}", "x", timeout_s=1.0)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("address, says", [
    ("nocolon", "is not HOST:PORT"), ("host:99999", "is not HOST:PORT"), ("http://host:1", "is not a Ray address"),
    ("ray://bogus.invalid", "the host bogus.invalid does not resolve"),
])
def test_malformed_addresses_are_named(address, says):
    with pytest.raises(RayAddressError, match=f"trainer.ray_address={address} .*{says}"):
        check_ray_address(address, "trainer.ray_address")


_INIT_RAY = """
import sys, time
import ray
from hybridrl.controller.cluster import RayAddressError, init_ray
started = time.monotonic()
try:
    init_ray(sys.argv[1])
except RayAddressError as error:
    print(f"{error}|{time.monotonic() - started:.1f}|{ray.is_initialized()}")
"""


def test_init_ray_refuses_before_ray_init():
    """The library entry point gets the same bounded check (no Ray connection attempted, nothing initialized). In a
    process of its own: the test session's workers hold a Ray cluster of their own already."""
    port = _closed_port()
    done = subprocess.run([sys.executable, "-c", _INIT_RAY, f"127.0.0.1:{port}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    message, seconds, initialized = done.stdout.strip().rsplit("|", 2)
    assert f"address=127.0.0.1:{port} cannot be reached" in message, done.stderr[-2000:]
    assert float(seconds) < 10 and initialized == "False"
