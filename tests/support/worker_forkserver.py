"""The test session's Ray workers and `hybridrl train` drivers, forked from processes that imported what they import.

A fresh Ray worker of a CPU run spends ~12 CPU-s importing torch, megatron-core, vLLM's engine and transformers
before its first call returns; the suite starts a few hundred of them (two or more per `hybridrl train`, again at
every restart in place, the worker tests). Forked from a process that imported them once, a worker skips that: the
standards' "fork ranks from an imported parent" (the rank server, `forked.py`), applied to the processes Ray starts.
Only the test session does this; a user's workers are plain interpreters.

How Ray is told: the session exports `RAY_RUNTIME_ENV_HOOK=tests.support.worker_forkserver.hook`, Ray's own hook,
which each driver's `ray.init` applies to its job's runtime environment: `hook` sets the job's `py_executable` to
this file's client. The raylet then execs `<python> -I -S worker_forkserver.py <socket> <the worker's argv>` where
it would exec `<python> <the worker's argv>`. The client hands its argv, environment, working directory and
standard streams to the server, which forks a child that runs them: Ray's `default_worker.py` as `__main__`. The
client stays the process the raylet started and knows: it relays the signals it gets to the child and exits as the
child exits (a signal death by that signal); if the client dies first (the raylet's SIGKILL), the server kills the
child's process group; if the server dies, its children die with it.

A worker the server cannot stand for runs as a plain interpreter (the client execs it): no server yet (it binds its
socket once its imports are done), a client in another network namespace (a host of `netns_hosts.py`: a worker
lives on its own host), or an environment that differs in a variable read once at process start (`FIXED_AT_START`).

What a forked worker takes from its client, beyond the environment (replaced whole): the working directory, umask,
streams, PYTHONPATH, PYTHONWARNINGS and TORCH_LOGS (applied again when they differ from the server's), and
OMP_NUM_THREADS (torch's thread count). Ray is not preloaded: loading `ray._raylet` snapshots every `RAY_*` variable
(RAY_JOB_ID among them) into Ray's C++ config, so each worker imports Ray itself, under its own environment; vLLM's
module that remembered Ray as missing is imported again once Ray is allowed.

Drivers: a second server per test process (`start("drivers")`, with the environment a driver inherits) imported
what a `hybridrl train` driver imports (`DRIVER_PRELOAD`: ~5 of its ~7 CPU-s of imports); `python_command` gives
the command line that runs `python -m hybridrl.cli ...` through the same client (tests/support/runs.py's `train`).
A driver forked from it runs `-m` modules as the interpreter does (sys.path[0] the working directory, argv[0] the
module's file). The tests of signals and of what a run leaves behind start plain ones (`plain_interpreters`).
"""
from __future__ import annotations

import array
import json
import os
import signal
import socket
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import subprocess

# What a worker imports before its first call returns, less Ray and hybridrl (both import Ray). Not vLLM's CPU
# worker: importing it replaces `torch.cuda.Stream` in the whole process (forked.py). Nothing here starts a thread.
PRELOAD: tuple[str, ...] = ("torch", "megatron.core", "vllm.entrypoints.llm", "transformers")
# What a `hybridrl train` driver imports (~5 of its ~7 CPU-s of imports), less Ray and hybridrl: torch (the
# controller's batches), transformers' auto classes (the tokenizer; they import torch's distributed tensors and
# dynamo), the summary plot's figure and Agg canvas (not pyplot, which picks a backend at import), Ray's aiohttp
DRIVER_PRELOAD: tuple[str, ...] = ("torch", "transformers.models.auto.auto_factory", "matplotlib.figure",
                                   "matplotlib.backends.backend_agg", "aiohttp")
ServerKind = Literal["workers", "drivers"]
PRELOADS: dict[ServerKind, tuple[str, ...]] = {"workers": PRELOAD, "drivers": DRIVER_PRELOAD}
# vLLM modules that import Ray at module level inside try/except (re-imported in a worker, where Ray is allowed)
RAY_OPTIONAL: tuple[str, ...] = ("vllm.v1.executor.ray_utils",)
# Read once when a process starts (glibc's malloc, the dynamic loader, the interpreter, torch's C++ logging): a worker
# whose environment differs from the server's in one of them runs as a plain interpreter. Not LD_LIBRARY_PATH: cv2
# (imported with vLLM) prepends its own folder to it in every process that imports it, the test session's included,
# so every run's workers would differ; what it adds is where cv2 finds libraries the server has loaded already.
FIXED_AT_START: tuple[str, ...] = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX", "LD_PRELOAD",
                                   "PYTHONHASHSEED", "PYTHONMALLOC", "TORCH_CPP_LOG_LEVEL")
SOCKET_ENV = "HYBRIDRL_TEST_WORKER_FORKSERVER"
DRIVER_SOCKET_ENV = "HYBRIDRL_TEST_DRIVER_FORKSERVER"
HOOK = "tests.support.worker_forkserver.hook"
_PLAIN = b"plain\n"
_START_ENV: dict[str, str] = {}  # the server's environment when it started (its imports change some: cv2's loader path)


def _netns() -> str:
    return str(os.stat("/proc/self/ns/net").st_ino)


# ------------------------------------------------------------------ started and stopped by the test session
class Server:
    """The running server: `stop()` ends it (its workers with it) and removes its socket."""

    def __init__(self, process: subprocess.Popen, folder: str, path: str) -> None:
        self.process = process
        self.folder = folder
        self.path = path

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until the server accepts (its imports done): drivers started after this fork their workers."""
        import time

        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fork server of {self.path} did not start: {self.describe()}")
            time.sleep(0.1)

    def alive(self) -> bool:
        return self.process.poll() is None

    def describe(self) -> str:
        """How it ended (or that it runs) and the end of its log."""
        state = "still running" if self.alive() else f"exit {self.process.returncode}"
        log = open(os.path.join(self.folder, "server.log"), errors="replace").read()[-3000:]
        return f"{state}; its log:\n{log}"

    def stop(self) -> None:
        import shutil

        self.process.kill()
        self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def start(kind: ServerKind = "workers") -> Server:
    """Start this process's server of `kind` (it imports for a few seconds, then binds its socket) and point what this
    process and its children start at it, in `os.environ`:

    - "workers": every Ray driver's workers (RAY_RUNTIME_ENV_HOOK, the socket's path, the repository on PYTHONPATH).
      The server runs with the CPU workers' own variables (`DevicePolicy.worker_env`: glibc reads its malloc
      settings once);
    - "drivers": the `hybridrl train` drivers the tests start through `python_command` (the socket's path). Started
      after the workers' server, with the environment a driver then inherits."""
    import subprocess  # noqa: F811 - at run time (the client, which shares this file, does without it)
    import tempfile

    from hybridrl.controller.cluster import _prepend_pythonpath
    from hybridrl.parallel.device_policy import CPU

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    folder = tempfile.mkdtemp(prefix=f"hrl-{kind}-")
    path = os.path.join(folder, "socket")
    env = {**os.environ, **dict(CPU.worker_env)} if kind == "workers" else dict(os.environ)
    process = subprocess.Popen([sys.executable, "-m", "tests.support.worker_forkserver", "--serve", path, kind],
                               env=env, cwd=root,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=open(os.path.join(folder, "server.log"), "wb"))
    if kind == "workers":
        os.environ[SOCKET_ENV] = path
        os.environ["RAY_RUNTIME_ENV_HOOK"] = HOOK
        # the hook is imported by every driver, whatever its working directory or script (`python bench/x.py`)
        os.environ["PYTHONPATH"] = _prepend_pythonpath([root])
    else:
        os.environ[DRIVER_SOCKET_ENV] = path
    return Server(process, folder, path)


def plain_interpreters(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a run whose driver and workers must be plain interpreters of the run's own process tree (the tests
    of what a run leaves behind, or of the signals its processes get)."""
    return {name: value for name, value in env.items() if name not in (SOCKET_ENV, DRIVER_SOCKET_ENV)}


def client_command(socket_path: str) -> list[str]:
    """The client's command line for the server listening on `socket_path`, less the program it is to run (an
    interpreter isolated from the environment's Python variables and site packages: it imports nothing but the
    standard library, and starts in milliseconds)."""
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), socket_path]


def python_command(args: list[str], env: Mapping[str, str]) -> list[str]:
    """The command line that runs `python *args` (a script or `-m module`, no interpreter flags) with `env`: forked
    from the drivers' server where `env` names one that accepts (the client falls back to a plain interpreter where
    the server cannot stand for it), else the interpreter itself."""
    path = env.get(DRIVER_SOCKET_ENV)
    if path and os.path.exists(path):
        return [*client_command(path), *args]
    return [sys.executable, *args]


# ------------------------------------------------------------------ the hook (in every driver of the session)
def hook(runtime_env: dict | None) -> dict:
    """Ray's RAY_RUNTIME_ENV_HOOK: the job's workers start through the client while the server's socket exists."""
    runtime_env = dict(runtime_env or {})
    path = os.environ.get(SOCKET_ENV)
    if path and os.path.exists(path) and "py_executable" not in runtime_env:
        runtime_env["py_executable"] = " ".join(client_command(path))
    return runtime_env


# ------------------------------------------------------------------ the client (exec'd by the raylet for a worker)
def _plain(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *argv])


def _client(path: str, argv: list[str]) -> None:
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        server_netns = sock.recv(64).decode()
    except OSError:
        server_netns = ""
    if server_netns != _netns():
        _plain(argv)
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "umask": os.umask(0o022)})
    sock.sendmsg([request.encode() + b"\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
    reply = sock.makefile("rb")
    first = reply.readline()
    if first in (_PLAIN, b""):
        _plain(argv)
    child = int(first)

    def relay(signum: int, _frame: object) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, relay)
    status = reply.readline().strip()
    code = int(status) if status else 1
    if code < 0:  # the child died by a signal: so does the client, as the raylet would have seen the worker die
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


# ------------------------------------------------------------------ the server (one per test session process)
def _read_request(conn: socket.socket) -> tuple[dict | None, list[int]]:
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    if not message:  # a client of another namespace hung up
        return None, list(fds)
    while not message.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            return None, list(fds)
        message += more
    return json.loads(message), list(fds)


def _serve(path: str) -> dict:
    """Accept clients until killed; returns only in a forked child, with its client's request."""
    import selectors

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".binding")
    os.rename(path + ".binding", path)  # the hook sees the socket only once it accepts
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    children: dict[int, tuple[socket.socket, int]] = {}  # pidfd -> (the client's connection, the child's pid)
    netns = _netns().encode()
    while True:
        for key, _ in selector.select():
            if key.data is None:  # a new client
                conn, _ = listener.accept()
                conn.sendall(netns)
                request, fds = _read_request(conn)
                differ = [] if request is None else [name for name in FIXED_AT_START
                                                     if request["env"].get(name) != _START_ENV.get(name)]
                if request is None or differ:
                    for fd in fds:
                        os.close(fd)
                    if request is not None:
                        print(f"plain worker: its {', '.join(differ)} differ from this server's", file=sys.stderr,
                              flush=True)
                        conn.sendall(_PLAIN)
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    for pidfd, (other, _) in children.items():
                        other.close()
                        os.close(pidfd)
                    conn.close()
                    for target, fd in enumerate(fds):
                        os.dup2(fd, target)
                        os.close(fd)
                    return request
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"{pid}\n".encode())
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (conn, pid)
                selector.register(pidfd, selectors.EVENT_READ, ("exited", pidfd))
                selector.register(conn, selectors.EVENT_READ, ("client", pidfd))
            elif key.data[0] == "exited":
                pidfd = key.data[1]
                conn, pid = children.pop(pidfd)
                selector.unregister(pidfd)
                if conn.fileno() in selector.get_map():  # not when its client died first (the branch below)
                    selector.unregister(conn)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()
            else:  # the client's end closed while its child runs: the client was killed
                conn, pid = children[key.data[1]]
                if conn.recv(1) == b"":
                    selector.unregister(conn)
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


def _die_with_parent() -> None:
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _run_request(request: dict) -> None:
    """In the forked child: take the client's process state, then run what it asked for as `__main__` (Ray's worker
    script, or a driver's `-m` module)."""
    import importlib
    import runpy
    import warnings

    _die_with_parent()
    os.setpgid(0, 0)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    if os.environ.get("PYTHONWARNINGS") != _START_ENV.get("PYTHONWARNINGS"):
        specs = [s for s in os.environ.get("PYTHONWARNINGS", "").split(",") if s]
        sys.warnoptions[:] = specs
        warnings._processoptions(specs)  # type: ignore[attr-defined]
    if os.environ.get("TORCH_LOGS") != _START_ENV.get("TORCH_LOGS"):
        import torch._logging._internal as torch_logging

        torch_logging._init_logs()
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    argv = list(request["argv"])
    while argv and argv[0].startswith("-") and argv[0] != "-m":  # interpreter flags ahead of the script
        argv.pop(0)
    module = argv[1] if argv[0] == "-m" else None
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    # sys.path[0] as the interpreter sets it: the working directory under -m, else the script's folder
    sys.path[:1] = [os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0])), *extra]
    for name in RAY_OPTIONAL:
        if name in sys.modules:
            importlib.reload(sys.modules[name])
    if module is not None:
        sys.argv = [module, *argv[2:]]  # run_module sets argv[0] to the module's file, as -m does
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


class _NoRay:
    """A meta-path finder that refuses Ray while the server preloads (`ray._raylet` would snapshot its environment)."""

    @staticmethod
    def find_spec(name: str, path: object = None, target: object = None) -> None:
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"{name} is imported by each worker itself, not preloaded")
        return None


def _server_main(path: str, kind: ServerKind) -> None:
    import importlib

    _START_ENV.update(os.environ)
    _die_with_parent()
    sys.meta_path.insert(0, _NoRay)  # type: ignore[arg-type]
    for module in PRELOADS[kind]:
        importlib.import_module(module)
    sys.meta_path.remove(_NoRay)  # type: ignore[arg-type]
    from hybridrl.parallel.heap import freeze_heap

    freeze_heap()
    request = _serve(path)
    _run_request(request)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        kind = sys.argv[3]
        if kind not in PRELOADS:
            raise SystemExit(f"no fork server of kind {kind!r} (the kinds: {', '.join(PRELOADS)})")
        _server_main(sys.argv[2], kind)  # type: ignore[arg-type] - checked just above
    else:
        _client(sys.argv[1], sys.argv[2:])
