"""Reward calls with a deadline (``algorithm.custom_reward_function.timeout_s``), in worker processes: ``num_workers``
of them score a batch's calls at once (1 by default: one after another), and a worker is killed when a call it runs
outlives the deadline.

A process, not a thread: a thread cannot be stopped, so a hung call would go on running (a CPU-bound one burning
a core) for the rest of the run; and a regular expression that backtracks catastrophically runs in `re`'s C
code holding the GIL, so the thread that should notice the deadline does not run at all (a SIGALRM handler, too,
runs only between bytecodes: after the match). A process stops whatever it runs: the worker leads a session of
its own and the whole process group is sent SIGKILL, so a subprocess or sandbox the function started goes with it.

Each worker is started with `subprocess` (not forked: the trainer holds Ray's, torch's and vLLM's threads, and a
fork copies the locks they hold; not a `multiprocessing` daemon either, which may not start processes of its own,
as a reward function with a process pool does), dies with the trainer (``PR_SET_PDEATHSIG``), and builds the
scorer itself from a `ScorerRecipe` (the user's file and function, or a registry name) as the trainer built its
own. The workers are started together at the first batch (as many as it has calls, up to `num_workers`), serve
batch after batch, and one is started again only after a kill (or after it ended between batches). The calling
thread waits on all of them at once (`multiprocessing.connection.wait`): each worker's answers and deadline are its
own, and a killed worker's replacement starts while the others go on.

The deadlines, per call:

* a plain function's calls run one at a time in each worker, `num_workers` at once: each call goes to whichever
  worker is free (with one worker the batch is sent whole and answered call after call) and may take `timeout_s`
  from when it starts; past that its worker is killed, that sample is `TimedOut`, the others go on, and a new
  worker takes the killed one's place as soon as a call waits for it (this batch's, or the next batch's). A call
  that ends its worker (``os._exit``, a crash) fails that sample alone (`Failed`), the same way;
* an ``async def`` function's calls of a batch are split into `num_workers` contiguous shares (one worker: the
  whole batch), each share awaited together in its worker's event loop, each call cancelled at `timeout_s` from
  the start of that wait (a `TimedOut` answer, and the worker goes on). Shares rather than one worker: the
  calls are still all in flight at once, and the work the coroutines do between their awaits (parsing a judge's
  answer, a sympy check) runs on `num_workers` cores. A call that blocks the loop instead (blocking work inside
  ``async def``) holds back its share's answers: past `timeout_s` + `AWAIT_GRACE_S` the worker is killed and the
  share's unanswered calls run again one at a time (on whichever worker is free), each with its own deadline,
  so only the call that hangs on its own times out. Whether a function is ``async def`` is read from its
  definition in the worker (`_declares_async`); a plain function that returns awaitables anyway is answered
  correctly, each call awaited alone, and from the next batch on its calls are split into shares.

Outcomes come back in the batch's order, whichever worker answered first. Answers cross the pipe already converted
(`ScoreResult`, or `Failed` with the reason): nothing the user's code returns or raises has to pickle.
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
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe, wait
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
Item = tuple[int, str, Any, dict[str, Any]]  # a call: the batch row, the response, the ground truth, the metadata


@dataclass
class _Job:
    """Calls sent to a worker in one message: a plain function's answered one after another, an async function's
    awaited together (`one_at_a_time`: each awaited alone, after its share blocked the event loop)."""

    items: list[Item]
    one_at_a_time: bool = False


class _Worker:
    """One worker process and the job it runs: started, then ready (it built the scorer), then busy with a job or
    idle, until it is closed (killed); a closed one is started again when a job needs it."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self._stop: weakref.finalize | None = None  # stops the process: close(), garbage collection, or at exit
        self.ready = False
        self.job: _Job | None = None
        self.awaiting = False  # the job's calls are being awaited together
        self.deadline = 0.0  # of its start, or of the call (or awaited share) it runs

    @property
    def started(self) -> bool:
        return self.conn is not None

    @property
    def busy(self) -> bool:
        """Starting, or running a job: an answer or a deadline is due."""
        return self.conn is not None and (not self.ready or self.job is not None)

    def launch(self, recipe_bytes: bytes) -> None:
        """Start the process; its ("ready", pid, whether the scorer is async) answer is due within START_TIMEOUT_S."""
        parent, child = Pipe(duplex=True)
        root = str(Path(__file__).resolve().parents[2])  # the folder holding this hybridrl
        boot = ("import sys; sys.path.insert(0, sys.argv[2]); "
                "from hybridrl.rewards.isolation import worker_main; worker_main(int(sys.argv[1]))")
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", boot, str(child.fileno()), root], pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        finally:
            child.close()
        self.conn = parent
        self._stop = weakref.finalize(self, _stop_worker, self.process, parent)
        self.deadline = time.monotonic() + START_TIMEOUT_S
        parent.send((list(sys.path), os.getpid()))
        parent.send_bytes(recipe_bytes)  # read after the path is set: the recipe may name the user's modules

    def run(self, job: _Job, timeout_s: float) -> None:
        assert self.conn is not None and self.ready and self.job is None
        self.conn.send(("score", job.items, timeout_s, job.one_at_a_time))
        self.job, self.awaiting = job, False
        self.deadline = time.monotonic() + timeout_s

    def receive(self, seconds: float) -> tuple[Any, ...] | None:
        """The worker's next message; None when none came within `seconds`, ("ended", exit code) when it ended."""
        assert self.conn is not None and self.process is not None
        try:
            if not self.conn.poll(max(seconds, 0.0)):
                return None
            return self.conn.recv()  # type: ignore[no-any-return]
        except (EOFError, OSError):
            try:
                return ("ended", self.process.wait(timeout=5))
            except subprocess.TimeoutExpired:  # it closed its end and lives on: as good as gone
                return ("ended", None)

    def ended_idle(self) -> bool:
        """A ready worker whose process ended between jobs (killed from outside, or its parent thread ended)."""
        return self.ready and self.job is None and self.process is not None and self.process.poll() is not None

    def close(self) -> None:
        """Kill the process and what it started (its process group)."""
        stop, self._stop = self._stop, None
        self.process, self.conn = None, None
        self.ready, self.job, self.awaiting = False, None, False
        if stop is not None:
            stop()


class IsolatedScorer:
    """Calls one scorer in `num_workers` worker processes, each call under `timeout_s` (see the module docstring)."""

    def __init__(self, recipe: ScorerRecipe, timeout_s: float, num_workers: int = 1) -> None:
        try:
            self.recipe_bytes = pickle.dumps(recipe)
        except Exception as error:  # noqa: BLE001 - here, at start-up, not at the first batch
            raise ValueError(f"a scorer with a time limit runs in a process of its own, which cannot rebuild "
                             f"{recipe.scorer!r} ({type(error).__name__}: {error}): give a module's function, a "
                             "registry name or a reward file, or no time limit") from error
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an integer >= 1, got {num_workers!r}")
        self.timeout_s = timeout_s
        self.num_workers = num_workers
        self._lock = threading.Lock()  # one batch at a time (the async rollout's thread and validation)
        self._workers = [_Worker() for _ in range(num_workers)]
        self._awaits: bool | None = None  # whether the scorer's calls return awaitables: its first worker says

    @property
    def pids(self) -> list[int]:
        """The worker processes running now (ready, or building the scorer)."""
        return [worker.process.pid for worker in self._workers if worker.process is not None]

    def close(self) -> None:
        """Kill the workers and what they started (their process groups); a later batch starts new ones."""
        for worker in self._workers:
            worker.close()

    # ------------------------------------------------------------------------------ scoring
    def call_each(self, responses: Sequence[str], ground_truths: Sequence[Any],
                  extras: Sequence[Mapping[str, Any]]) -> list[Outcome]:
        """Each sample's outcome, in order: a ScoreResult, a `Failed` or a `TimedOut`."""
        items = [(row, response, truth, dict(extra))
                 for row, (response, truth, extra) in enumerate(zip(responses, ground_truths, extras))]
        outcomes: dict[int, Outcome] = {}
        with self._lock:
            try:
                if items:
                    self._run(items, outcomes)
            except BaseException:  # Ctrl-C mid-batch: the workers' answers would meet the next batch
                self.close()
                raise
        return [outcomes[row] for row, *_ in items]

    def _jobs(self, items: list[Item]) -> list[_Job] | None:
        """The batch as the jobs the workers take; None while it depends on whether the scorer awaits (no worker
        has said yet)."""
        if self.num_workers == 1:
            return [_Job(items)]  # the batch in one message, answered call after call (or awaited together)
        if self._awaits is None:
            return None
        if not self._awaits:
            return [_Job([item]) for item in items]  # each call to whichever worker is free
        shares = min(self.num_workers, len(items))
        bounds = [len(items) * share // shares for share in range(shares + 1)]
        return [_Job(items[start:stop]) for start, stop in zip(bounds, bounds[1:])]

    def _run(self, items: list[Item], outcomes: dict[int, Outcome]) -> None:
        """Hand the batch's jobs to the workers and collect their answers into `outcomes`, until every call has
        one: killing each worker whose call (or awaited share) outlives its deadline, starting workers for the jobs
        no worker is free for."""
        queue: deque[_Job] | None = None
        while True:
            if queue is None and (jobs := self._jobs(items)) is not None:
                queue = deque(jobs)
            for worker in self._workers:
                if worker.ended_idle():
                    worker.close()
                if queue and worker.ready and worker.job is None:
                    worker.run(queue.popleft(), self.timeout_s)
            waiting = len(queue) if queue is not None else min(len(items), self.num_workers)
            starting = sum(1 for worker in self._workers if worker.started and not worker.ready)
            for worker in self._workers:
                if starting >= waiting:
                    break
                if not worker.started:
                    worker.launch(self.recipe_bytes)
                    starting += 1
            busy = [worker for worker in self._workers if worker.busy]
            if queue is not None and not queue and not any(worker.job for worker in busy):
                assert len(outcomes) == len(items)
                return
            soonest = min(worker.deadline for worker in busy)
            wait([worker.conn for worker in busy if worker.conn is not None], max(soonest - time.monotonic(), 0.0))
            for worker in busy:
                while worker.busy:  # its answers so far; then whether its deadline passed without one
                    message = worker.receive(0.0)
                    if message is None and time.monotonic() < worker.deadline:
                        break
                    if not worker.ready:
                        self._started(worker, message)
                    elif message is None or message[0] == "ended":  # past the deadline, or the worker ended
                        assert queue is not None
                        self._lost(worker, message, queue, outcomes)
                    else:
                        self._answered(worker, message, outcomes)

    def _started(self, worker: _Worker, message: tuple[Any, ...] | None) -> None:
        if message is not None and message[0] == "ready":
            worker.ready = True
            if self._awaits is None:
                self._awaits = bool(message[2])
            return
        self.close()  # ("load_failed", why), ("ended", code) or nothing
        why = (f"it did not start within {START_TIMEOUT_S:.0f} s" if message is None else
               message[1] if message[0] == "load_failed" else f"it ended (exit code {message[1]})")
        raise WorkerStartError(f"the reward process could not build the scorer: {why}")

    def _answered(self, worker: _Worker, message: tuple[Any, ...], outcomes: dict[int, Outcome]) -> None:
        kind = message[0]
        if kind == "result":
            outcomes[message[1]] = message[2]
            if not worker.awaiting:  # the job's next call starts now
                worker.deadline = time.monotonic() + self.timeout_s
        elif kind == "awaiting":
            worker.awaiting = True
            worker.deadline = time.monotonic() + self.timeout_s + AWAIT_GRACE_S
            self._awaits = True  # a plain function that returned awaitables: its next batches go in shares
        elif kind == "done":
            worker.job = None

    def _lost(self, worker: _Worker, ended: tuple[Any, ...] | None, queue: deque[_Job],
              outcomes: dict[int, Outcome]) -> None:
        """Kill a worker past its deadline (`ended` None), or close one that ended (("ended", exit code)): the call
        it ran is `TimedOut` or `Failed`, and its job's other unanswered calls go back to the front of the queue,
        for whichever worker is free (a new one in its place). A worker killed while awaiting its share is not
        blamed on one call: the share's unanswered calls run again one at a time, each a job of its own."""
        job, awaiting = worker.job, worker.awaiting
        assert job is not None
        worker.close()
        unanswered = [item for item in job.items if item[0] not in outcomes]
        if not unanswered:
            return
        if awaiting:
            queue.extendleft(reversed([_Job([item], one_at_a_time=True) for item in unanswered]))
            return
        first, *rest = unanswered
        outcomes[first[0]] = (TimedOut(self.timeout_s, stopped=True) if ended is None else
                              Failed(f"ended its process (exit code {ended[1]})"))
        if rest:
            queue.appendleft(_Job(rest, job.one_at_a_time))


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
    conn.send(("ready", os.getpid(), _declares_async(scorer)))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        _, items, timeout_s, one_at_a_time = message
        _score(conn, scorer, items, timeout_s, one_at_a_time)
        conn.send(("done",))


def _declares_async(scorer: Callable[..., Any]) -> bool:
    """Whether the scorer is an ``async def`` function (a callable object's ``__call__``), or the adapter of one
    that `hybridrl.rewards.custom.adapt_reward_function` made (`user_function`): its calls return awaitables."""
    function = getattr(scorer, "user_function", scorer)
    return inspect.iscoroutinefunction(function) or (
        not inspect.isroutine(function) and inspect.iscoroutinefunction(type(function).__call__))


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
