"""Ray bring-up: a private local cluster (tests, one node) or a connection to an existing cluster.

Local clusters here are shared machines' good citizens (see the Ray section of docs/platform.md):
bound to 127.0.0.1, token auth off (no ~/.ray/auth_token), a private short temp dir (Ray's unix
socket paths must stay short), no dashboard, warnings-only logging. Never `ray stop`: it kills
every Ray process on the machine by name, including other users' clusters.
"""
from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
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


class RayAddressError(ConnectionError):
    """A Ray address names no cluster that answers: an unresolvable host, a closed port, no reply, or not Ray."""


# What a Ray address may be, for the messages (`ray start --head` prints the first).
RAY_ADDRESS_FORMS = ("HOST:PORT of a running Ray head (ray start --head prints it)", "ray://HOST:PORT (Ray Client)",
                     "auto (the cluster this machine joined)", "unset or local (a private local cluster)")
RAY_CLIENT_PORT = 10001
# The HTTP/2 connection preface and an empty SETTINGS frame: a gRPC server (Ray's GCS, the Ray Client server)
# answers with a SETTINGS frame of its own.
_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS_FRAME = 4


def check_ray_address(address: str, field: str = "address", timeout_s: float = 10.0) -> None:
    """Refuse a Ray address that cannot be a cluster, within about 3 x `timeout_s`, with `RayAddressError` naming
    `field`, the value and the forms that are valid: the host resolved, a TCP connection to the port, and a gRPC
    reply on it. Without this, `ray.init` retries "Failed to connect to GCS" for many minutes, in native code that
    a SIGTERM does not interrupt. `auto` and `local` are Ray's to resolve; a TLS cluster (RAY_USE_TLS) is not
    probed past the connection."""
    problem = ray_address_problem(address, timeout_s)
    if problem:
        raise RayAddressError(f"{field}={address} {problem}; valid: {'; '.join(RAY_ADDRESS_FORMS)}")


def ray_address_problem(address: str, timeout_s: float = 10.0) -> str | None:
    """Why nothing answers as a Ray cluster at `address` (see `check_ray_address`), or None."""
    if address in ("auto", "local"):
        return None
    text, client = address, address.startswith("ray://")
    if client:
        text = text.removeprefix("ray://")
    elif "://" in text:
        return "is not a Ray address (only ray:// addresses carry a scheme)"
    host, sep, port_text = text.rstrip("/").rpartition(":")
    if not sep:
        host, port_text = text.rstrip("/"), str(RAY_CLIENT_PORT) if client else ""
    host = host.removeprefix("[").removesuffix("]")  # [::1]:6379
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return "is not HOST:PORT (a port from 1 to 65535)"
    port = int(port_text)
    try:
        addresses = _resolve(host, port, timeout_s)
    except TimeoutError:
        return f"cannot be reached: resolving the host {host} took over {timeout_s:g} s"
    except OSError as exc:
        return f"cannot be reached: the host {host} does not resolve ({exc})"
    errors = []
    for family, kind, proto, _, sockaddr in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.settimeout(timeout_s)
            try:
                sock.connect(sockaddr)
            except ConnectionRefusedError:
                errors.append(f"{sockaddr[0]} refused the connection: nothing listens on port {port}")
                continue
            except TimeoutError:
                errors.append(f"{sockaddr[0]} did not answer on port {port} within {timeout_s:g} s")
                continue
            except OSError as exc:
                errors.append(f"{sockaddr[0]}: {exc}")
                continue
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
                return None
            return _grpc_problem(sock, port)
    return "cannot be reached: " + "; ".join(dict.fromkeys(errors))


def _resolve(host: str, port: int, timeout_s: float) -> list:
    """`getaddrinfo` with a time limit (it can block on a dead resolver): run in a daemon thread left behind."""
    answer: queue.Queue = queue.Queue()

    def work() -> None:
        try:
            answer.put(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            answer.put(exc)

    threading.Thread(target=work, daemon=True, name="resolve-ray-address").start()
    try:
        result = answer.get(timeout=timeout_s)
    except queue.Empty as exc:
        raise TimeoutError(host) from exc
    if isinstance(result, OSError):
        raise result
    return result


def _grpc_problem(sock: socket.socket, port: int) -> str | None:
    """None when the connected peer answers HTTP/2 (a gRPC server, as Ray's GCS is), else why not."""
    try:
        sock.sendall(_HTTP2_HELLO)
        reply = b""
        while len(reply) < 9:
            chunk = sock.recv(9 - len(reply))
            if not chunk:
                break
            reply += chunk
    except TimeoutError:
        return f"accepts a connection on port {port} but does not answer as a Ray cluster (no gRPC reply)"
    except OSError as exc:
        return f"accepts a connection on port {port} but then fails: {exc}"
    if len(reply) < 9 or reply[3] != _SETTINGS_FRAME:
        return f"accepts a connection on port {port} but is not a Ray cluster (no gRPC server there)"
    return None


def gcs_answers(timeout_s: float = 2.0) -> bool:
    """Whether the GCS of the cluster this process is connected to still accepts a connection and answers gRPC
    (`ray_address_problem`), within about `timeout_s`; False when not connected."""
    if not ray.is_initialized():
        return False
    return ray_address_problem(ray.get_runtime_context().gcs_address, timeout_s) is None


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
        check_ray_address(address, "address")  # bounded: ray.init alone retries for many minutes
        runtime_env = {}
        if pythonpath:
            runtime_env = {"env_vars": {"PYTHONPATH": _prepend_pythonpath(pythonpath)}}
        with stop_signals_held() as received:
            context = ray.init(address=address, namespace=namespace, runtime_env=runtime_env or None, **quiet)
        cluster = RayCluster(context.address_info.get("address", address), False, None, False)
        if received:
            _deliver_after_start(received[0], cluster)
        return cluster

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
    with stop_signals_held() as received:
        try:
            context = ray.init(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                object_store_memory=object_store_memory,
                namespace=namespace,
                include_dashboard=False,
                _temp_dir=temp_dir,
                _system_config=_local_system_config(preload_modules),
                **quiet,
            )
        except BaseException:  # a failed start: what it made so far goes too
            RayCluster("", True, temp_dir, owns_temp_dir).shutdown()
            raise
    cluster = RayCluster(context.address_info.get("address", ""), True, temp_dir, owns_temp_dir)
    if received:
        _deliver_after_start(received[0], cluster)
    return cluster


def _local_system_config(preload_modules: Sequence[str]) -> dict[str, object]:
    """A local cluster's Ray settings. No worker processes started ahead of the first task: when the driver
    connects, Ray starts idle workers (one per logical CPU, up to the machine's cores; `preload_modules` imported in
    each), and this project's actors never take them: each asks for its device's environment (`worker_process_env`),
    so Ray starts it a process of its own. The idle ones only cost each start their imports (two torch imports on a
    2-core machine, one per core of a GPU node) and their memory for the run's life. `preload_modules` still go
    into every worker Ray starts."""
    config: dict[str, object] = {"prestart_worker_first_driver": False}
    if preload_modules:
        config["preload_python_modules"] = list(preload_modules)
    return config


# What a user sends to stop a run: Ctrl-C, SLURM's and Kubernetes' SIGTERM, a closed terminal's SIGHUP.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def stop_signals_held() -> Iterator[list[int]]:
    """Hold the stop signals while `ray.init` starts a local cluster (the list yielded gets those that arrived), and
    leave the process's own handlers in place after it.

    Interrupted midway, `ray.init` leaves its temp folder and, from the raylet's start on, its dashboard and
    runtime-env agents, alive for a minute or more, that nothing can stop: the half-started node is nowhere to shut
    down. `ray.init` also takes over SIGTERM twice: a Python handler that kills the cluster under the caller and
    exits from wherever the main thread is, and Ray's native one, which prints a stack dump and aborts the process;
    the caller's own handling (`hybridrl train` stops cleanly, as on Ctrl-C) is put back. Outside the main thread,
    where no handler can be set, nothing is held."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    utils = ray._private.utils
    ray_setter = utils.set_sigterm_handler
    utils.set_sigterm_handler = lambda handler: None  # ray.init's, while it runs; Ray's native one is undone below
    try:
        for signum in STOP_SIGNALS:
            signal.signal(signum, lambda signum, frame: received.append(signum))
        yield received
    finally:
        utils.set_sigterm_handler = ray_setter
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _deliver_after_start(signum: int, cluster: RayCluster) -> None:
    """Act on a stop signal held during the start, as the process's handler would have, now that `cluster` is
    whole: stopped first if that handler stops the process (an exception, or the default action), kept if it
    ignores the signal."""
    handler = signal.getsignal(signum)
    if handler == signal.SIG_IGN:
        return
    if handler in (signal.SIG_DFL, None):  # the process ends at once: nothing after this would stop the cluster
        cluster.shutdown()
        signal.raise_signal(signum)
        return
    try:
        signal.raise_signal(signum)  # runs the handler here (KeyboardInterrupt on Ctrl-C)
    except BaseException:
        cluster.shutdown()
        raise
