"""Ray bring-up: a private local cluster (tests, one node) or a connection to an existing cluster.

Local clusters here are shared machines' good citizens (see the Ray section of docs/platform.md):
bound to 127.0.0.1, token auth off (no ~/.ray/auth_token), a private short temp dir (Ray's unix
socket paths must stay short), no dashboard, warnings-only logging. Never `ray stop`: it kills
every Ray process on the machine by name, including other users' clusters.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

# Ray reads this when it is imported, to decide whether a local cluster listens on the machine's
# external address or on loopback; set it before our `import ray`. Connecting to an existing
# cluster takes addresses from that cluster and is unaffected.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402

logger = logging.getLogger(__name__)


@dataclass
class RayCluster:
    """What `init_ray` connected to. `shutdown()` disconnects (and stops a cluster started here)."""

    address: str
    started_here: bool
    temp_dir: str | None
    owns_temp_dir: bool

    def resources(self) -> dict[str, float]:
        return dict(ray.cluster_resources())

    def shutdown(self) -> None:
        if ray.is_initialized():
            ray.shutdown()
        if self.owns_temp_dir and self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def _prepend_pythonpath(paths: Sequence[str]) -> str:
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    merged = [os.path.abspath(p) for p in paths if os.path.abspath(p) not in current] + current
    return os.pathsep.join(merged)


def init_ray(
    address: str | None = None,
    *,
    num_cpus: float | None = None,
    num_gpus: int | None = None,
    object_store_memory: int | None = None,
    temp_dir: str | None = None,
    namespace: str | None = None,
    pythonpath: Sequence[str] = (),
    log_to_driver: bool = True,
    preload_modules: Sequence[str] = (),
) -> RayCluster:
    """Start a private local Ray cluster, or connect to an existing one.

    `address` (or the RAY_ADDRESS environment variable) selects an existing cluster; None or
    "local" starts a local one with `num_cpus`/`num_gpus` logical resources. `pythonpath` entries
    are made importable in every worker process (e.g. the repository root, so actor classes defined
    in test modules can be unpickled there): exported before the local cluster starts, or passed as
    the job's runtime env when connecting.
    """
    if ray.is_initialized():
        raise RuntimeError("Ray is already initialized in this process; call ray.shutdown() first")
    address = address if address is not None else os.environ.get("RAY_ADDRESS")
    quiet = {"logging_level": logging.WARNING, "log_to_driver": log_to_driver}
    if address and address != "local":
        runtime_env = {}
        if pythonpath:
            runtime_env = {"env_vars": {"PYTHONPATH": _prepend_pythonpath(pythonpath)}}
        context = ray.init(address=address, namespace=namespace, runtime_env=runtime_env or None, **quiet)
        return RayCluster(context.address_info.get("address", address), False, None, False)

    if ray._private.ray_constants.ENABLE_RAY_CLUSTER:  # imported before us: cannot bind loopback
        logger.warning(
            "ray was imported before hybridrl.controller; the local cluster will listen on external "
            "addresses. Import hybridrl.controller first or export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0."
        )
    # Token auth would write ~/.ray/auth_token; a private loopback cluster needs none.
    os.environ["RAY_AUTH_MODE"] = "disabled"
    if pythonpath:
        os.environ["PYTHONPATH"] = _prepend_pythonpath(pythonpath)
    owns_temp_dir = temp_dir is None
    if temp_dir is None:
        temp_dir = tempfile.mkdtemp(prefix="hrl-ray-", dir="/tmp")
    # RAY_ADDRESS would make ray.init connect instead of starting a private cluster.
    os.environ.pop("RAY_ADDRESS", None)
    context = ray.init(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        object_store_memory=object_store_memory,
        namespace=namespace,
        include_dashboard=False,
        _temp_dir=temp_dir,
        _system_config={"preload_python_modules": list(preload_modules)} if preload_modules else None,
        **quiet,
    )
    return RayCluster(context.address_info.get("address", ""), True, temp_dir, owns_temp_dir)
