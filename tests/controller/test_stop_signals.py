"""Stop signals around `init_ray`: one that arrives while Ray starts stops the whole cluster once it is up (nothing
left running, its temp folder gone), and Ray's own SIGTERM handlers do not stay in place of the caller's.

Each case runs in a process of its own (a session of its own, so that what it leaves running can be listed): the test
session's workers hold a Ray cluster already, and the signals go to that process.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.support.runs import ROOT, session_left_running
from tests.support.worker_forkserver import plain_interpreters

# The child reports the temp folder init_ray made (spied on, not replaced) and what the signal did.
_SIGNAL_WHILE_STARTING = """
import json, os, signal, sys, tempfile, threading, time
import ray
from hybridrl.controller import cluster

made = []
real_mkdtemp = tempfile.mkdtemp
tempfile.mkdtemp = lambda *args, **kwargs: made.append(real_mkdtemp(*args, **kwargs)) or made[-1]

class Stop(Exception):
    pass

def stop(signum, frame):
    raise Stop(signum)

signum = getattr(signal, sys.argv[1])
# Python's own SIGINT handler (KeyboardInterrupt), which a process started with SIGINT ignored, as a shell's
# background job is, does not get
signal.signal(signal.SIGINT, signal.default_int_handler)
if signum != signal.SIGINT:  # SIGINT keeps Python's own handler: KeyboardInterrupt
    signal.signal(signum, stop)
started = time.monotonic()
threading.Timer(0.3, os.kill, (os.getpid(), signum)).start()  # ray.init takes seconds: this lands inside it
try:
    cluster.init_ray("local", num_cpus=1)
    raised = None
except BaseException as error:
    raised = type(error).__name__
print(json.dumps({"raised": raised, "initialized": ray.is_initialized(), "temp_dir": made[0],
                  "seconds": time.monotonic() - started}))
"""


@pytest.mark.parametrize("name, raised", [("SIGINT", "KeyboardInterrupt"), ("SIGTERM", "Stop")])
def test_a_stop_signal_while_ray_starts_stops_the_whole_cluster_once_it_is_up(name, raised):
    """Ctrl-C (or a scheduler's SIGTERM) in the first seconds of a run used to land inside `ray.init`: the half-started
    node was nowhere to shut down, so its temp folder stayed, and so, from the raylet's start on, did its dashboard and
    runtime-env agents, for a minute or more (SIGTERM went to Ray's handler, which exited from inside `ray.init`)."""
    child = subprocess.Popen([sys.executable, "-c", _SIGNAL_WHILE_STARTING, name], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                             env=plain_interpreters(os.environ))
    out, err = child.communicate(timeout=120)
    report = json.loads(out.strip().splitlines()[-1])
    assert report["raised"] == raised, err[-3000:]  # the caller's own handler acted, after the start
    assert not report["initialized"]
    assert not os.path.exists(report["temp_dir"]), f"{report['temp_dir']} left behind"
    assert session_left_running(child.pid, wait_s=15) == []


_HANDLER_KEPT = """
import os, signal, sys
from hybridrl.controller.cluster import init_ray

handled = []
def mine(signum, frame):
    handled.append(signum)

signal.signal(signal.SIGTERM, mine)
cluster = init_ray("local", num_cpus=1)
kept = signal.getsignal(signal.SIGTERM) is mine
os.kill(os.getpid(), signal.SIGTERM)  # Ray's handlers: a native stack dump, the cluster killed, an abort
print(f"kept={kept} handled={handled}", flush=True)
cluster.shutdown()
"""


def test_init_ray_leaves_the_callers_sigterm_handler_in_place():
    """`ray.init` installs a Python SIGTERM handler that kills the cluster under the caller and exits, and a native
    one that prints a stack dump and aborts: `hybridrl train` stopped by SLURM or Kubernetes exited with 134 and
    that dump, not its own clean stop."""
    child = subprocess.run([sys.executable, "-c", _HANDLER_KEPT], cwd=ROOT, capture_output=True, text=True,
                           timeout=120, start_new_session=True)
    assert child.returncode == 0, child.stderr[-3000:]
    assert f"kept=True handled=[{int(signal.SIGTERM)}]" in child.stdout
    assert "SIGTERM received" not in child.stderr
