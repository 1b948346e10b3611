"""Reward calls with a deadline (``algorithm.custom_reward_function.timeout_s``): each runs in a process of its
own, which is killed when a call outlives the deadline.

A process, not a thread: a thread cannot be stopped, so a hung call would go on running (a CPU-bound one burning
a core) for the rest of the run; and a regular expression that backtracks catastrophically runs in `re`'s C
code holding the GIL, so the thread that should notice the deadline does not run at all (a SIGALRM handler, too,
runs only between bytecodes: after the match). A process stops whatever it runs: the worker leads a session of
its own and the whole process group is sent SIGKILL, so a subprocess or sandbox the function started goes with it.

The worker is started with `subprocess` (not forked: the trainer holds Ray's, torch's and vLLM's threads, and a
fork copies the locks they hold; not a `multiprocessing` daemon either, which may not start processes of its own,
as a reward function with a process pool does), dies with the trainer (``PR_SET_PDEATHSIG``), and builds the
scorer itself from a `ScorerRecipe` (the user's file and function, or a registry name) as the trainer built its
own. It serves batch after batch and is started again only after a kill.

The deadlines, per call:

* a plain function's calls run one after another: each may take `timeout_s` from when it starts (the previous
  answer); past that the worker is killed, that sample is `TimedOut`, and a new worker goes on with the next;
* an ``async def`` function's calls of a batch are awaited together in one event loop, each cancelled at
  `timeout_s` from the start of that wait (a `TimedOut` answer, and the worker goes on). A call that blocks the
  loop instead (blocking work inside ``async def``) holds back every answer: past `timeout_s` + `AWAIT_GRACE_S`
  the worker is killed and the unanswered calls run again one at a time, each with its own deadline, so only
  the call that hangs on its own times out.

Answers cross the pipe already converted (`ScoreResult`, or `Failed` with the reason): nothing the user's code
returns or raises has to pickle.
"""
from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any

# past an async batch's deadline, how long the answers of calls cancelled at it may take to arrive
AWAIT_GRACE_S = 1.0
# how long a new worker may take to import the reward file and build its scorer
START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Failed:
    """A call that raised, returned something that is not a score, or ended its process: `problem` says which."""

    problem: str
    cause: BaseException | None = None  # the exception, where the call ran in this process
    trace: str = ""  # the worker's traceback of it, where it ran there


@dataclass(frozen=True)
class TimedOut:
    """A call that outlived its deadline; `stopped`: its process was killed (else the coroutine was cancelled)."""

    seconds: float
    stopped: bool


@dataclass(frozen=True)
class ScorerRecipe:
    """How a worker builds the trainer's scorer: a user's reward file (`path`, `function`, `reward_kwargs`), a
    registry scorer (`registry`, `options`), or a function it imports by reference (`scorer`)."""

    path: str | None = None
    function: str = "compute_score"
    reward_kwargs: Mapping[str, Any] | None = None
    registry: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    scorer: Callable[..., Any] | None = None

    def build(self) -> Callable[[str, Any, Mapping[str, Any]], Any]:
        from hybridrl.rewards.custom import adapt_reward_function, load_reward_function
        from hybridrl.rewards.registry import get_scorer

        if self.path is not None:
            return adapt_reward_function(load_reward_function(self.path, self.function), self.reward_kwargs)
        if self.registry is not None:
            return get_scorer(self.registry, **self.options)
        assert self.scorer is not None
        return self.scorer


class WorkerStartError(RuntimeError):
    """The worker could not build the scorer (its file failed to import there), or did not start."""


Outcome = Any  # a ScoreResult, Failed or TimedOut


class IsolatedScorer:
    """Calls one scorer in a worker process, each call under `timeout_s` (see the module docstring)."""

    def __init__(self, recipe: ScorerRecipe, timeout_s: float) -> None:
        try:
            self.recipe_bytes = pickle.dumps(recipe)
        except Exception as error:  # noqa: BLE001 - here, at start-up, not at the first batch
            raise ValueError(f"a scorer with a time limit runs in a process of its own, which cannot rebuild "
                             f"{recipe.scorer!r} ({type(error).__name__}: {error}): give a module's function, a "
                             "registry name or a reward file, or no time limit") from error
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # one batch at a time (the async rollout's thread and validation)
        self._process: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._stop: weakref.finalize | None = None  # stops the worker: close(), garbage collection, or at exit
        self.pid: int | None = None  # the worker's, while it runs

    # ------------------------------------------------------------------------------ the worker's life
    def _start(self) -> Connection:
        parent, child = Pipe(duplex=True)
        root = str(Path(__file__).resolve().parents[2])  # the folder holding this hybridrl
        boot = ("import sys; sys.path.insert(0, sys.argv[2]); "
                "from hybridrl.rewards.isolation import worker_main; worker_main(int(sys.argv[1]))")
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", boot, str(child.fileno()), root], pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        finally:
            child.close()
        self._conn = parent
        self._stop = weakref.finalize(self, _stop_worker, self._process, parent)
        parent.send((list(sys.path), os.getpid()))
        parent.send_bytes(self.recipe_bytes)  # read after the path is set: the recipe may name the user's modules
        message = self._receive(START_TIMEOUT_S)
        if message is None or message[0] != "ready":  # ("load_failed", why), ("ended", code) or nothing
            self.close()
            why = (f"it did not start within {START_TIMEOUT_S:.0f} s" if message is None else
                   message[1] if message[0] == "load_failed" else f"it ended (exit code {message[1]})")
            raise WorkerStartError(f"the reward process could not build the scorer: {why}")
        self.pid = int(message[1])
        return parent

    def _receive(self, seconds: float) -> tuple[Any, ...] | None:
        """The worker's next message; None when none came within `seconds`, ("ended", exit code) when it ended."""
        assert self._conn is not None and self._process is not None
        try:
            if not self._conn.poll(max(seconds, 0.0)):
                return None
            return self._conn.recv()  # type: ignore[no-any-return]
        except (EOFError, OSError):
            try:
                return ("ended", self._process.wait(timeout=5))
            except subprocess.TimeoutExpired:  # it closed its end and lives on: as good as gone
                return ("ended", None)

    def close(self) -> None:
        """Kill the worker and what it started (its process group); a later batch starts a new one."""
        stop, self._stop = self._stop, None
        self._process = None
        self._conn = None
        self.pid = None
        if stop is not None:
            stop()

    # ------------------------------------------------------------------------------ scoring
    def call_each(self, responses: Sequence[str], ground_truths: Sequence[Any],
                  extras: Sequence[Mapping[str, Any]]) -> list[Outcome]:
        """Each sample's outcome, in order: a ScoreResult, a `Failed` or a `TimedOut`."""
        items = [(row, response, truth, dict(extra))
                 for row, (response, truth, extra) in enumerate(zip(responses, ground_truths, extras))]
        outcomes: dict[int, Outcome] = {}
        one_at_a_time = False
        with self._lock:
            try:
                while len(outcomes) < len(items):
                    if self._process is None or self._process.poll() is not None:  # never started, or ended idle
                        self.close()
                        self._start()
                    blocked = self._run([item for item in items if item[0] not in outcomes], outcomes, one_at_a_time)
                    one_at_a_time = one_at_a_time or blocked
            except BaseException:  # Ctrl-C mid-batch: the worker's answers would meet the next batch
                self.close()
                raise
        return [outcomes[row] for row, *_ in items]

    def _run(self, items: list[tuple[int, str, Any, dict[str, Any]]], outcomes: dict[int, Outcome],
             one_at_a_time: bool) -> bool:
        """Send `items` to the worker and collect its answers into `outcomes` until it is done or killed; whether it
        was killed with async calls unanswered (then they are run again one at a time)."""
        assert self._conn is not None
        self._conn.send(("score", items, self.timeout_s, one_at_a_time))
        awaiting = False
        deadline = time.monotonic() + self.timeout_s
        while True:
            message = self._receive(deadline - time.monotonic())
            if message is None or message[0] == "ended":  # past the deadline, or the worker ended
                self.close()
                unanswered = [row for row, *_ in items if row not in outcomes]
                if not unanswered:
                    return False
                if awaiting:
                    return True
                outcomes[unanswered[0]] = (TimedOut(self.timeout_s, stopped=True) if message is None else
                                           Failed(f"ended its process (exit code {message[1]})"))
                return False
            kind = message[0]
            if kind == "result":
                outcomes[message[1]] = message[2]
                if not awaiting:  # the next call starts now
                    deadline = time.monotonic() + self.timeout_s
            elif kind == "awaiting":
                awaiting = True
                deadline = time.monotonic() + self.timeout_s + AWAIT_GRACE_S
            elif kind == "done":
                return False


def _stop_worker(process: subprocess.Popen[bytes], conn: Connection) -> None:
    conn.close()
    try:
        os.killpg(process.pid, signal.SIGKILL)  # its own session: the group is it and what it started
    except (ProcessLookupError, PermissionError):
        process.kill()
    process.wait(timeout=30)


# ------------------------------------------------------------------------------ in the worker process
def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the trainer ends (Linux's PR_SET_PDEATHSIG), even mid-call."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the trainer ended before the line above
        os._exit(1)


def worker_main(fd: int) -> None:
    conn = Connection(fd)
    sys_path, parent = conn.recv()
    _die_with_parent(parent)
    sys.path[:] = list(dict.fromkeys([*sys_path, *sys.path]))  # the trainer's: its user modules import here too
    try:
        scorer = conn.recv().build()  # the ScorerRecipe, from the trainer that started this process
    except Exception as error:  # noqa: BLE001 - said to the trainer, which raises it
        conn.send(("load_failed", f"{type(error).__name__}: {error}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        _, items, timeout_s, one_at_a_time = message
        _score(conn, scorer, items, timeout_s, one_at_a_time)
        conn.send(("done",))


def _failed(error: BaseException) -> Failed:
    return Failed(f"raised {type(error).__name__}: {error}", trace="".join(traceback.format_exception(error)))


def _converted(value: Any) -> Outcome:
    """A return value as the answer sent back: a ScoreResult of plain values, or why it is not a score."""
    from hybridrl.rewards.manager import as_score_result, plain_details
    from hybridrl.rewards.registry import ScoreResult

    result = as_score_result(value)
    if isinstance(result, str):
        return Failed(result)
    return ScoreResult(result.score, result.acc, plain_details(result.details))


def _score(conn: Connection, scorer: Callable[..., Any], items: list[tuple[int, str, Any, dict[str, Any]]],
           timeout_s: float, one_at_a_time: bool) -> None:
    waiting: list[tuple[int, Any]] = []
    for row, response, truth, extra in items:
        try:
            value = scorer(response, truth, extra)
        except Exception as error:  # noqa: BLE001 - that sample's failure
            conn.send(("result", row, _failed(error)))
            continue
        if not inspect.isawaitable(value):
            conn.send(("result", row, _converted(value)))
        elif one_at_a_time:
            asyncio.run(_await_each(conn, [(row, value)], timeout_s))
        else:
            waiting.append((row, value))
    if waiting:
        conn.send(("awaiting",))
        asyncio.run(_await_each(conn, waiting, timeout_s))


async def _await_each(conn: Connection, waiting: list[tuple[int, Any]], timeout_s: float) -> None:
    """Await the calls together, each answered as it ends, or when it is cancelled at `timeout_s`."""
    answered: set[int] = set()

    def answer(row: int, task: asyncio.Future[Any]) -> None:
        if row in answered or task.cancelled():
            return
        answered.add(row)
        error = task.exception()
        conn.send(("result", row, _converted(task.result()) if error is None else _failed(error)))

    tasks = {}
    for row, value in waiting:
        task = asyncio.ensure_future(value)
        task.add_done_callback(lambda task, row=row: answer(row, task))
        tasks[task] = row
    done, late = await asyncio.wait(tasks, timeout=timeout_s)
    for task in done:  # its callback may not have run yet
        answer(tasks[task], task)
    for task in late:
        answered.add(tasks[task])
        conn.send(("result", tasks[task], TimedOut(timeout_s, stopped=False)))
        task.cancel()
