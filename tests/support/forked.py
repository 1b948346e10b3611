"""Run a function on N local ranks joined in one gloo group, forked from a pre-imported server.

Spawning a fresh interpreter per rank costs 5-15 s of `import megatron.core` on 2 cores; forking
from a process that already imported it costs milliseconds. We fork from multiprocessing's
*forkserver* (a clean single-threaded process that preloads torch and megatron once) rather than
from the caller, because the caller may hold threads (Ray, gRPC, OpenMP) that make a plain fork
unsafe.

Used by tests, benchmarks and the offline tools; training at scale uses Ray worker groups
(`hybridrl.controller`) instead.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

DEFAULT_PRELOAD: tuple[str, ...] = ("torch", "megatron.core", "hybridrl.parallel.state")
# What a vLLM engine in a rank imports (~8 s on 2 cores; `import vllm` alone is lazy and costs nothing):
# a process whose ranks build engines again and again (the test session) preloads it once. Not vLLM's
# CPU worker: importing it replaces `torch.cuda.Stream` with a placeholder in the whole process, which
# would hide from every rank the CUDA calls the CPU layer exists to catch.
VLLM_PRELOAD: tuple[str, ...] = ("vllm.entrypoints.llm",)
# Imported by the rank server after the preload: freezes its heap for the ranks it forks (the module's docstring).
FROZEN_HEAP = "tests.support.frozen_heap"
_context: Any = None
_server_preload: tuple[str, ...] | None = None  # chosen by set_server_preload, or the first call's


class RankError(RuntimeError):
    """A rank raised, died or timed out; carries the rank and the remote traceback. `detail` holds every
    failing rank's traceback that arrived within a short grace, the cause first (`rank` is its rank)."""

    def __init__(self, rank: int, detail: str):
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank
        self.detail = detail


# What a rank reports when a peer died first: the peer's failure is the cause, not this one.
_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "connection refused")
# How long the parent waits, after the first failure, for the other ranks to report theirs: a cause and
# its consequence can arrive in either order (a peer's gloo error may beat the failing rank's own report).
_GRACE_S = 3.0


def _is_peer_loss(detail: str) -> bool:
    last_line = detail.strip().splitlines()[-1] if detail.strip() else ""
    return any(marker.lower() in last_line.lower() for marker in _PEER_LOSS)


def _rank_error(failures: dict[int, str]) -> RankError:
    """One error for every failure seen, the likeliest cause first: a rank that did not merely lose a peer,
    else the lowest rank."""
    order = sorted(failures, key=lambda rank: (_is_peer_loss(failures[rank]), rank))
    if len(order) == 1:
        return RankError(order[0], failures[order[0]])
    detail = "\n".join(f"--- rank {rank} ---\n{failures[rank]}" for rank in order)
    return RankError(order[0], detail)


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now (another process may take it
    before the caller binds it: `run_ranks` does not rely on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def set_server_preload(modules: Sequence[str]) -> None:
    """Choose what the rank server imports, once, before it forks any rank. The server is one per
    process and starts at the first `run_ranks`; after that its preload cannot change."""
    global _server_preload
    modules = tuple(modules)
    if _context is not None and modules != _server_preload:
        raise RuntimeError(f"the rank server already runs with preload {_server_preload}; "
                           f"set_server_preload({modules}) must come before the first run_ranks")
    _server_preload = modules


def _forkserver(preload: Sequence[str]) -> Any:
    """The process's one forkserver, started with `set_server_preload`'s modules, else `preload`. A later
    call's other modules are not preloaded: its ranks import them themselves (seconds, not an error)."""
    global _context, _server_preload
    if _context is None:
        if _server_preload is None:
            _server_preload = tuple(preload)
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload([*_server_preload, FROZEN_HEAP])
    return _context


def _rank_main(conn, fn, rank: int, world_size: int, port: int, timeout_s: float, args, kwargs):
    import torch
    import torch.distributed as dist

    # Ranks share 2 cores: one intra-op thread each keeps them from fighting over the cores.
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
    )
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        result = fn(rank, world_size, *args, **kwargs)
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent with its traceback
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        conn.close()
        # Skip interpreter teardown: gloo/megatron globals are not needed, and os._exit cannot hang.
        os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    preload: Sequence[str] = DEFAULT_PRELOAD,
    **kwargs: Any,
) -> list[Any]:
    """Call `fn(rank, world_size, *args, **kwargs)` on `world_size` forked ranks; return per-rank results.

    torch.distributed is initialized (gloo, loopback) before `fn` runs. `fn` must be importable by
    module path (a module-level function). `preload` is what the rank server imports if this call
    starts it (the process's first; `set_server_preload` chooses it for every call instead). The
    first failure gives the other ranks a few seconds to report theirs, then kills them and raises one
    `RankError` holding every failure seen, the cause first (a rank that only lost its peer comes after);
    a rank that does not answer within `timeout_s` fails the same way.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    import torch.distributed as dist

    ctx = _forkserver(preload)
    # The parent serves the ranks' rendezvous store on a port it keeps bound until they finish: a
    # port picked free and bound later by rank 0 can be taken in between by a concurrent run.
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    port = store.port
    procs, conns = [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_rank_main,
            args=(child_conn, fn, rank, world_size, port, timeout_s, args, kwargs),
            daemon=True,
        )
        proc.start()
        child_conn.close()
        procs.append(proc)
        conns.append(parent_conn)

    results: list[Any] = [None] * world_size
    failures: dict[int, str] = {}
    pending = set(range(world_size))
    deadline = time.monotonic() + timeout_s
    try:
        while pending:
            for rank in sorted(pending):
                outcome = _poll_rank(conns[rank], procs[rank])
                if outcome is None:
                    continue
                pending.discard(rank)
                status, payload = outcome
                if status == "error":
                    failures[rank] = payload
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
                else:
                    results[rank] = payload
            if time.monotonic() > deadline:
                if not failures:
                    failures[min(pending)] = f"no result within {timeout_s:.0f} s"
                break
        if failures:
            raise _rank_error(failures)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        for conn in conns:
            conn.close()
        del store
    return results


def _poll_rank(conn: Any, proc: Any) -> tuple[str, Any] | None:
    """("ok", result) or ("error", detail) once the rank has answered or died; None while it runs."""
    if conn.poll(0.05):
        try:
            return pickle.loads(conn.recv_bytes())
        except EOFError:
            proc.join(timeout=1)
            return "error", f"exited with code {proc.exitcode} without a result"
    if not proc.is_alive() and not conn.poll(0):
        return "error", f"died with exit code {proc.exitcode}"
    return None
