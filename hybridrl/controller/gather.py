"""Fail-fast gathering: run one method on every rank and return when all finish, or fail in seconds.

Why not `ray.get(refs)`: it waits on the refs in order, so a failure on rank 5 stays invisible
while rank 0 is blocked in a collective waiting for rank 5 (with torch's default process-group
timeout, for 30 minutes), and a blocking `ray.get` cannot be interrupted by pytest-timeout. We poll
`ray.wait` in short slices instead, and on the first failed rank kill the whole group: its peers
may be stuck in a gloo/NCCL collective that will never complete.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from hybridrl.controller.dispatch import RankCall


@dataclass(frozen=True)
class RankFailure:
    rank: int
    kind: str  # "exception", "actor died", PEER_LOST or "ray error"
    detail: str  # the remote traceback (exceptions) or Ray's account of the death
    cause: str = ""  # an exception's own line ("DeviceMismatch: ..."), for the one-line account of the failure


class WorkerGroupError(RuntimeError):
    """A worker group call failed on some rank (or hung past its timeout); the group is torn down.

    `rank` and `remote_traceback` describe the first failure seen; `failures` lists all failures
    seen at that moment; `unfinished_ranks` were still running (often blocked in a collective).
    """

    def __init__(
        self,
        group: str,
        method: str,
        failures: Sequence[RankFailure],
        unfinished_ranks: Sequence[int],
        torn_down: bool,
        timeout_s: float | None = None,
    ):
        self.group = group
        self.method = method
        self.failures = list(failures)
        self.unfinished_ranks = list(unfinished_ranks)
        self.torn_down = torn_down
        first = self.failures[0] if self.failures else None
        self.rank: int | None = first.rank if first else None
        self.remote_traceback: str = first.detail if first else ""
        if first is not None:
            head = f"{group} rank {first.rank} failed in {method}(): {first.cause or first.kind}"
        else:
            head = (f"{group} group did not finish {method}() within {timeout_s} s (ranks that did not answer: "
                    f"{self.unfinished_ranks})")
        lines = [head]
        others = [f.rank for f in self.failures[1:]]
        if others:
            lines.append(f"also failed at the same time: ranks {others}")
        if self.unfinished_ranks:
            lines.append(f"ranks still running at that moment: {self.unfinished_ranks}")
        lines.append(
            "worker group torn down (all its actors killed)" if torn_down else "worker group left running"
        )
        for failure in self.failures:
            lines.append(f"--- {group} rank {failure.rank} ({failure.kind}) ---\n{failure.detail.rstrip()}")
        super().__init__("\n".join(lines))

    def locate(self, node_addresses: Sequence[str]) -> None:
        """Name the node (by address) of each failed rank, after the first line: on many nodes, a node whose
        ranks died (a host lost, killed or cut off) is what a reader looks for first."""
        if not self.failures or len(set(node_addresses)) < 2:
            return
        where = "; ".join(f"rank {f.rank} on node {node_addresses[f.rank]} ({f.kind})" for f in self.failures
                          if f.rank < len(node_addresses))
        died = sorted({node_addresses[f.rank] for f in self.failures
                       if f.kind == ACTOR_DIED and f.rank < len(node_addresses)})
        held = {node: [r for r, a in enumerate(node_addresses) if a == node] for node in died}
        lost = "".join(f"; an actor died on node {node} (it held {self.group} ranks {ranks}): killed (out of "
                       "memory?), or the host was lost or cut off" for node, ranks in held.items())
        head, _, rest = str(self).partition("\n")
        self.args = (f"{head}\nwhere: {where}{lost}" + (f"\n{rest}" if rest else ""),)


# A rank whose collective broke because a peer vanished is a symptom, not the cause: gloo reports
# "Connection closed by peer" on the survivors within milliseconds, often before Ray has noticed the
# peer's death. These markers (torch's c10d error types and gloo/NCCL messages) identify them.
_COLLECTIVE_ERROR_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")
_COLLECTIVE_ERROR_MARKERS = (
    "Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted",
)
PEER_LOST = "collective failed (a peer is gone)"
ACTOR_DIED = "actor died"


# how much of an exception's message the one-line account keeps (the whole report has all of it)
CAUSE_CHARS = 400


def _cause_line(cause: BaseException | None) -> str:
    """`Type: first line of the message`, cut to CAUSE_CHARS: what the one-line account of a failure says."""
    if cause is None:
        return ""
    message = str(cause).strip().splitlines()
    line = f"{type(cause).__name__}: {message[0]}" if message else type(cause).__name__
    return line if len(line) <= CAUSE_CHARS else line[:CAUSE_CHARS - 3] + "..."


def _classify(error: RayError, rank: int) -> RankFailure:
    """The failure of `rank` that a Ray error reports."""
    if isinstance(error, RayTaskError):
        cause = getattr(error, "cause", None)
        text = str(error)
        peer_lost = type(cause).__name__ in _COLLECTIVE_ERROR_TYPES or any(
            marker in text for marker in _COLLECTIVE_ERROR_MARKERS
        )
        return RankFailure(rank, PEER_LOST if peer_lost else "exception", text,
                           "" if peer_lost else _cause_line(cause))
    if isinstance(error, RayActorError):
        return RankFailure(rank, ACTOR_DIED, str(error))
    return RankFailure(rank, "ray error", f"{type(error).__name__}: {error}")


def _root_causes_first(failures: list[RankFailure]) -> list[RankFailure]:
    return sorted(failures, key=lambda f: (f.kind == PEER_LOST, f.rank))


def kill_actors(actors: Sequence[ActorHandle]) -> None:
    """Kill every actor now (no restart). Already-dead actors are fine."""
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - a dead actor or a lost handle: nothing left to kill
            pass


def submit_all(actors: Sequence[ActorHandle], method: str, calls: Sequence[RankCall]) -> list[ray.ObjectRef]:
    """Start `method` on every rank (rank r gets calls[r]); returns one ref per rank."""
    if len(calls) != len(actors):
        raise ValueError(f"got {len(calls)} calls for {len(actors)} ranks")
    return [getattr(actor, method).remote(*c.args, **c.kwargs) for actor, c in zip(actors, calls)]


def wait_all(
    refs: Sequence[ray.ObjectRef],
    actors: Sequence[ActorHandle],
    *,
    group: str,
    method: str,
    timeout_s: float | None = None,
    poll_s: float = 0.5,
    tear_down_on_failure: bool = True,
    root_cause_grace_s: float = 3.0,
    on_poll: Callable[[], None] | None = None,
) -> list[Any]:
    """Results of `refs` (one per rank) in rank order; raise WorkerGroupError on the first failure.

    When the only failures so far are broken collectives (symptoms of a vanished peer), wait up to
    `root_cause_grace_s` more for the failure that caused them, so the error names the right rank.
    `on_poll` runs after every poll slice: a caller waiting on two groups at once (a rollout pool
    running ahead of the trainer) raises from it when the other group has failed.
    """
    results: list[Any] = [None] * len(refs)
    pending: dict[ray.ObjectRef, int] = {ref: rank for rank, ref in enumerate(refs)}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failures: list[RankFailure] = []
    unfinished_at_failure: list[int] = []
    grace_deadline = None
    while pending:
        slice_s = poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic()))
        if grace_deadline is not None:
            slice_s = max(0.0, min(slice_s, grace_deadline - time.monotonic()))
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=slice_s)
        for ref in ready:
            rank = pending.pop(ref)
            try:
                results[rank] = ray.get(ref, timeout=0)
            except GetTimeoutError:  # wait said ready but the value is not local yet: next slice
                pending[ref] = rank
            except RayError as error:
                failures.append(_classify(error, rank))
        if failures:
            if grace_deadline is None:  # the poll that saw the first failure
                unfinished_at_failure = sorted(pending.values())
            only_symptoms = all(f.kind == PEER_LOST for f in failures)
            if grace_deadline is None:
                grace_deadline = time.monotonic() + root_cause_grace_s
            if only_symptoms and pending and time.monotonic() < grace_deadline:
                continue
            failures = _root_causes_first(failures)
            failed = {f.rank for f in failures}
            unfinished = [r for r in unfinished_at_failure if r not in failed]
            if tear_down_on_failure:
                kill_actors(actors)
            raise WorkerGroupError(group, method, failures, unfinished, tear_down_on_failure)
        if on_poll is not None and pending:
            on_poll()
        if deadline is not None and pending and time.monotonic() >= deadline:
            unfinished = sorted(pending.values())
            if tear_down_on_failure:
                kill_actors(actors)
            raise WorkerGroupError(group, method, [], unfinished, tear_down_on_failure, timeout_s)
    return results


def execute_all(
    actors: Sequence[ActorHandle],
    method: str,
    calls: Sequence[RankCall],
    *,
    group: str,
    timeout_s: float | None = None,
    poll_s: float = 0.5,
    tear_down_on_failure: bool = True,
    root_cause_grace_s: float = 3.0,
) -> list[Any]:
    """Run `method` on every rank with its call's arguments; results in rank order.

    On the first exception or dead actor: kill all `actors` (unless told not to) and raise
    WorkerGroupError with the group's name, rank, method and the remote traceback. `timeout_s` bounds the
    whole call (None: no bound; failures are still detected within `poll_s`).
    """
    refs = submit_all(actors, method, calls)
    return wait_all(
        refs, actors, group=group, method=method, timeout_s=timeout_s, poll_s=poll_s,
        tear_down_on_failure=tear_down_on_failure, root_cause_grace_s=root_cause_grace_s,
    )
