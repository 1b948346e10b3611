"""Test-only fault injection: make one worker die, or poison one update, at a chosen point.

Set `HYBRIDRL_FAULT="<phase>:<call>:<rank>"` in the environment of `hybridrl train` (Ray workers of
a local cluster inherit it). The rank whose global rank is `<rank>` then, on its `<call>`-th
(1-based) entry into `<phase>`:
  generate, sync, log_prob, update, checkpoint   exits at once with `os._exit(1)` (a crash: no
                                                 exception, no clean-up, peers left in collectives)
  nan_update                                     sets its advantages to NaN (a non-finite step)
Several faults: separate them with commas. Unset (the normal case) every hook is a dict lookup.
`HYBRIDRL_FAULT_MARK=<file>`: a crashing rank first writes the wall-clock time into that file, so a
test can measure how long the controller takes to surface the failure.
Nothing else reads this variable; it exists so the reliability tests can inject real failures.
"""
from __future__ import annotations

import os
import time
from collections import Counter

ENV = "HYBRIDRL_FAULT"
CRASH_PHASES = ("generate", "sync", "log_prob", "update", "checkpoint")
PHASES = CRASH_PHASES + ("nan_update",)

_calls: Counter[str] = Counter()


def parse(spec: str) -> list[tuple[str, int, int]]:
    """`"update:2:1,sync:1:0"` -> [("update", 2, 1), ("sync", 1, 0)]; a bad spec raises ValueError."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        parts = item.split(":")
        if len(parts) != 3 or parts[0] not in PHASES or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError(f"{ENV}={spec!r}: expected <phase>:<call>:<rank> with phase in {PHASES}")
        faults.append((parts[0], int(parts[1]), int(parts[2])))
    return faults


def triggered(phase: str) -> bool:
    """Count this rank's entry into `phase`; True when a fault is set for exactly this entry."""
    spec = os.environ.get(ENV)
    if not spec:
        return False
    _calls[phase] += 1
    rank = int(os.environ.get("RANK", "-1"))
    return (phase, _calls[phase], rank) in parse(spec)


def crash_point(phase: str) -> None:
    """Exit the process here, without clean-up, when a crash is set for this entry into `phase`."""
    if triggered(phase):
        mark = os.environ.get(ENV + "_MARK")
        if mark:
            with open(mark, "w") as handle:
                handle.write(f"{time.time()}\n")
        os._exit(1)
