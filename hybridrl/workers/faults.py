"""Test-only fault injection: make one worker die, or poison one update, at a chosen point.

Set `HYBRIDRL_FAULT="<fault>:<call>:<rank>"` in the environment of `hybridrl train` (Ray workers of
a local cluster inherit it). A fault point is named by the phase (`hybridrl.names.Phase`: the
trainer's timer names, as in `TrainingFailure`) in which the trainer makes the worker call holding
it. The rank whose global rank is `<rank>` then, on its `<call>`-th (1-based) entry into the point:
  gen, sync, old_log_prob,                     exits at once with `os._exit(1)` (a crash: no
  update_actor, save_checkpoint                exception, no clean-up, peers left in collectives)
  nan_update_actor                             sets its advantages to NaN (a non-finite step)
  gen_collective                               on its `<call>`-th generation, exits inside vLLM's
                                               first TP all-reduce (its TP peers are in it: infer_tp > 1)
  hang_<phase> (one of the first five)         sleeps there forever (a deadlock outside any collective)
An optional fourth field `:<restart>` names the start of the workers the fault is for: 0 (the default)
is the run's first start, k its k-th in-place restart (`trainer.max_restarts`), so a fault fires once
per run and a test can fail a restarted run again. Several faults: separate them with commas. Unset
(the normal case) every hook is a dict lookup.
`HYBRIDRL_FAULT_MARK=<file>`: a crashing rank first appends the wall-clock time to that file (a line
a crash), so a test can measure how long the controller takes to surface each failure.
Nothing else reads this variable; it exists so the reliability tests can inject real failures.
"""
from __future__ import annotations

import os
import time
from collections import Counter
from typing import NoReturn

from hybridrl.controller.base_worker import RESTART_ENV
from hybridrl.names import Phase

ENV = "HYBRIDRL_FAULT"
CRASH_PHASES = (Phase.GEN, Phase.SYNC, Phase.OLD_LOG_PROB, Phase.UPDATE_ACTOR, Phase.SAVE_CHECKPOINT)
NAN_UPDATE_ACTOR = f"nan_{Phase.UPDATE_ACTOR}"  # poisons the update instead of crashing
GEN_COLLECTIVE = f"{Phase.GEN}_collective"  # crashes inside vLLM's own TP collective
HANGS = tuple(f"hang_{phase}" for phase in CRASH_PHASES)  # sleeps forever instead of crashing
FAULTS = (*CRASH_PHASES, NAN_UPDATE_ACTOR, GEN_COLLECTIVE, *HANGS)

_calls: Counter[str] = Counter()


def parse(spec: str) -> list[tuple[str, int, int, int]]:
    """`"update_actor:2:1,sync:1:0:1"` -> [("update_actor", 2, 1, 0), ("sync", 1, 0, 1)]: (fault, call,
    rank, restart); a bad spec raises ValueError."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        parts = item.split(":")
        if (len(parts) not in (3, 4) or parts[0] not in FAULTS
                or not all(part.isdigit() for part in parts[1:])):
            raise ValueError(f"{ENV}={spec!r}: expected <fault>:<call>:<rank>[:<restart>] with fault in "
                             f"{tuple(map(str, FAULTS))}")
        call, rank, restart = (int(part) for part in (*parts[1:], "0")[:3])
        faults.append((parts[0], call, rank, restart))
    return faults


def triggered(phase: Phase | str) -> bool:
    """Count this rank's entry into `phase`; True when a fault is set for exactly this entry."""
    spec = os.environ.get(ENV)
    if not spec:
        return False
    _calls[phase] += 1
    rank = int(os.environ.get("RANK", "-1"))
    restart = int(os.environ.get(RESTART_ENV, "0"))
    return (phase, _calls[phase], rank, restart) in parse(spec)


def _crash() -> NoReturn:
    mark = os.environ.get(ENV + "_MARK")
    if mark:
        with open(mark, "a") as handle:
            handle.write(f"{time.time()}\n")
    os._exit(1)


def crash_point(phase: Phase) -> None:
    """Exit the process here, without clean-up, when a crash is set for this entry into `phase`; or never
    return from here, when a hang is."""
    if triggered(phase):
        _crash()
    if triggered(f"hang_{phase}"):
        while True:
            time.sleep(3600)


def arm_vllm_collective_crash() -> None:
    """Called as a generation starts: when `gen_collective` is set for this entry, the next all-reduce
    of vLLM's own process groups (its TP all-reduce inside the model's forward) exits the process as
    it starts, its peers already inside or about to enter it."""
    if not triggered(GEN_COLLECTIVE):
        return
    from vllm.distributed.parallel_state import GroupCoordinator

    # Both of vLLM's all-reduce paths (the custom op and the direct call) end in this method.
    def crashing_all_reduce(self: GroupCoordinator, input_: object) -> object:
        _crash()

    GroupCoordinator._all_reduce_out_place = crashing_all_reduce
