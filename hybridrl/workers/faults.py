"""Test-only fault injection: make one worker die, or poison one update, at a chosen point.

Set `HYBRIDRL_FAULT="<fault>:<call>:<rank>"` in the environment of `hybridrl train` (Ray workers of
a local cluster inherit it). A fault point is named by the phase (`hybridrl.names.Phase`: the
trainer's timer names, as in `TrainingFailure`) in which the trainer makes the worker call holding
it. The rank whose global rank is `<rank>` then, on its `<call>`-th (1-based) entry into the point:
  gen, sync, old_log_prob,                     exits at once with `os._exit(1)` (a crash: no
  update_actor, save_checkpoint                exception, no clean-up, peers left in collectives)
  nan_update_actor                             sets its advantages to NaN (a non-finite step)
Several faults: separate them with commas. Unset (the normal case) every hook is a dict lookup.
`HYBRIDRL_FAULT_MARK=<file>`: a crashing rank first writes the wall-clock time into that file, so a
test can measure how long the controller takes to surface the failure.
Nothing else reads this variable; it exists so the reliability tests can inject real failures.
"""
from __future__ import annotations

import os
import time
from collections import Counter

from hybridrl.names import Phase

ENV = "HYBRIDRL_FAULT"
CRASH_PHASES = (Phase.GEN, Phase.SYNC, Phase.OLD_LOG_PROB, Phase.UPDATE_ACTOR, Phase.SAVE_CHECKPOINT)
NAN_UPDATE_ACTOR = f"nan_{Phase.UPDATE_ACTOR}"  # poisons the update instead of crashing
FAULTS = (*CRASH_PHASES, NAN_UPDATE_ACTOR)

_calls: Counter[str] = Counter()


def parse(spec: str) -> list[tuple[str, int, int]]:
    """`"update_actor:2:1,sync:1:0"` -> [("update_actor", 2, 1), ("sync", 1, 0)]; a bad spec raises ValueError."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        parts = item.split(":")
        if len(parts) != 3 or parts[0] not in FAULTS or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError(f"{ENV}={spec!r}: expected <fault>:<call>:<rank> with fault in {tuple(map(str, FAULTS))}")
        faults.append((parts[0], int(parts[1]), int(parts[2])))
    return faults


def triggered(phase: Phase | str) -> bool:
    """Count this rank's entry into `phase`; True when a fault is set for exactly this entry."""
    spec = os.environ.get(ENV)
    if not spec:
        return False
    _calls[phase] += 1
    rank = int(os.environ.get("RANK", "-1"))
    return (phase, _calls[phase], rank) in parse(spec)


def crash_point(phase: Phase) -> None:
    """Exit the process here, without clean-up, when a crash is set for this entry into `phase`."""
    if triggered(phase):
        mark = os.environ.get(ENV + "_MARK")
        if mark:
            with open(mark, "w") as handle:
                handle.write(f"{time.time()}\n")
        os._exit(1)
