"""The local cluster `init_ray` starts (a run on one machine): no worker processes ahead of the first task.

Ray starts one idle worker per logical CPU when the driver connects, and this project's actors never take them: each
asks for its device's environment (`worker_process_env`), so Ray starts it a process of its own. Run in a process of
its own: the test session's workers hold a Ray cluster already.
"""
from __future__ import annotations

import json
import subprocess
import sys

from tests.support.runs import ROOT

# The child starts a 4-CPU local cluster, one actor as WorkerGroup makes them (an environment of its own), and reports
# the raylet's worker processes a few seconds later, and whether the preloaded module reached the actor's process.
_LOCAL_CLUSTER = """
import json, sys, time
import psutil, ray
from hybridrl.controller import cluster

local = cluster.init_ray("local", num_cpus=4, preload_modules=["colorsys"])

@ray.remote
class Worker:
    def preloaded(self):
        return "colorsys" in sys.modules

actor = Worker.options(num_cpus=1, runtime_env={"env_vars": {"HYBRIDRL_TEST_WORKER": "1"}}).remote()
preloaded = ray.get(actor.preloaded.remote())
time.sleep(3)  # the idle workers Ray prestarts are up within a second of the driver's connection
raylet = next(p for p in psutil.Process().children(recursive=True) if "raylet" in " ".join(p.cmdline()[:1]))
workers = [" ".join(p.cmdline())[:80] for p in raylet.children() if "default_worker" in " ".join(p.cmdline())
           or p.cmdline()[:1] and p.cmdline()[0].startswith("ray::")]
workers = [w for w in workers if "Agent" not in w]
local.shutdown()
print(json.dumps({"preloaded": preloaded, "workers": workers}))
"""


def test_a_local_cluster_starts_no_worker_ahead_of_the_actors():
    child = subprocess.run([sys.executable, "-c", _LOCAL_CLUSTER], cwd=ROOT, capture_output=True, text=True,
                           timeout=180)
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["preloaded"]  # the preloaded module is still imported in every worker Ray starts
    # the actor's process alone (before: Ray's prestarted idle workers too, two on this 2-core machine, each with the
    # preloaded modules imported, never used)
    assert len(report["workers"]) == 1, report["workers"]
