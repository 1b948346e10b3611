"""The test session's fork servers (tests/support/worker_forkserver.py): a Ray worker forked from one is the worker Ray
asked for (its job, its environment, its signals, its end), a worker it cannot stand for is plain; a driver forked
from the other runs as the interpreter would have run it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.support import worker_forkserver
from tests.support.runs import ROOT
from tests.support.worker_forkserver import plain_interpreters, python_command

# A driver as `hybridrl train` is one (its own local cluster; the hook applies at ray.init): one actor with a CPU
# worker's runtime environment and variables of its own (argv[1]), asked what process it is; then killed as a hung
# worker is, and looked for.
DRIVER = r"""
import json, os, sys, time
import ray
from hybridrl.parallel.device_policy import CPU

ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)


@ray.remote(num_cpus=0.5)
class Probe:
    def __init__(self):
        self.preloaded = "megatron.core" in sys.modules  # before this worker imported anything itself

    def describe(self):
        with open(f"/proc/{os.getpid()}/cmdline", "rb") as cmdline:
            title = cmdline.read().split(b"\0")[0].decode()
        return {"pid": os.getpid(), "parent": os.getppid(), "preloaded": self.preloaded, "mine": os.environ["MINE"],
                "job": ray.get_runtime_context().get_job_id(), "title": title, "cwd": os.getcwd(),
                "rank_env": os.environ.get("HYBRIDRL_STRICT_DEVICE")}


# a CPU worker's variables, as the trainer's workers get them (the server started with the same: malloc's settings)
env_vars = {**dict(CPU.worker_env), "MINE": "from the actor's runtime env", **json.loads(sys.argv[1])}
probe = Probe.options(runtime_env={"env_vars": env_vars}).remote()
seen = ray.get(probe.describe.remote(), timeout=120)
seen["driver_job"] = ray.get_runtime_context().get_job_id()
ray.kill(probe)
deadline = time.monotonic() + 20
while os.path.exists(f"/proc/{seen['pid']}") and time.monotonic() < deadline:
    time.sleep(0.1)
seen["gone"] = not os.path.exists(f"/proc/{seen['pid']}")
print(json.dumps(seen))
"""


def _probe(env: dict[str, str], worker_env: dict[str, str] | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(worker_env or {})], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_worker_is_forked_from_the_server_and_is_the_worker_ray_asked_for(worker_fork_server):
    if worker_fork_server is None:
        pytest.fail("HYBRIDRL_TEST_PLAIN_WORKERS=1: this session runs no fork server to test")
    forked = _probe(dict(os.environ))
    assert forked["parent"] == worker_fork_server.process.pid  # forked by the server...
    assert forked["preloaded"]  # ...so megatron was there before the worker imported anything
    assert forked["mine"] == "from the actor's runtime env"  # the client's environment, taken whole
    assert forked["rank_env"] == os.environ["HYBRIDRL_STRICT_DEVICE"]
    assert forked["job"] == forked["driver_job"]  # Ray's C++ config read the worker's own RAY_JOB_ID
    assert forked["title"].startswith("ray::Probe")  # Ray named the process, as it names a plain worker
    assert forked["gone"], "the killed worker's forked process outlived its client"

    # the control: without the server's socket, a plain interpreter
    plain = _probe(plain_interpreters(dict(os.environ)))
    assert plain["parent"] != worker_fork_server.process.pid
    assert not plain["preloaded"]
    assert plain["mine"] == "from the actor's runtime env" and plain["job"] == plain["driver_job"] and plain["gone"]
    assert forked["cwd"] == plain["cwd"]  # the working directory Ray gave the worker


def test_a_worker_whose_start_time_settings_differ_runs_plain(worker_fork_server):
    """glibc reads MALLOC_* once at process start: a worker asking for other values than the server started with
    cannot be a fork of it."""
    if worker_fork_server is None:
        pytest.fail("HYBRIDRL_TEST_PLAIN_WORKERS=1: this session runs no fork server to test")
    seen = _probe(dict(os.environ), {"MALLOC_ARENA_MAX": "3"})
    assert seen["parent"] != worker_fork_server.process.pid
    assert not seen["preloaded"]


def test_the_server_outlives_a_client_killed_before_its_worker(worker_fork_server, tmp_path):
    """The raylet SIGKILLs a worker's process (the client) at a job's end or on `ray.kill`: the server kills the
    forked child and goes on serving the next worker (it used to die reaping that child, and its other children with
    it)."""
    if worker_fork_server is None:
        pytest.fail("HYBRIDRL_TEST_PLAIN_WORKERS=1: this session runs no fork server to test")
    from hybridrl.parallel.device_policy import CPU

    env = {**os.environ, **dict(CPU.worker_env)}
    client = worker_forkserver.client_command(worker_fork_server.path)
    (tmp_path / "sleeps.py").write_text("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)\n")
    (tmp_path / "parent.py").write_text("import os\nprint(os.getppid())\n")
    sleeping = subprocess.Popen([*client, str(tmp_path / "sleeps.py")], env=env, stdout=subprocess.PIPE, text=True)
    child = int(sleeping.stdout.readline())
    sleeping.kill()
    sleeping.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{child}"), "the forked child outlived its killed client"
    time.sleep(0.5)  # the server reaps it
    after = subprocess.run([*client, str(tmp_path / "parent.py")], env=env, capture_output=True, text=True,
                           timeout=60)
    assert after.returncode == 0, after.stderr[-2000:]
    assert int(after.stdout) == worker_fork_server.process.pid


# A module run as `python -m probe ...`: what the interpreter made of its command line and environment, on both
# streams, and an exit status of its own
PROBE = r"""
import json, os, sys
print(json.dumps({"parent": os.getppid(), "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
                  "name": __name__, "mine": os.environ.get("MINE"), "torch": "torch" in sys.modules}))
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


def test_a_driver_forked_from_the_drivers_server_runs_as_the_interpreter_runs_it(driver_fork_server, tmp_path):
    """`python_command` (how tests/support/runs.py starts `hybridrl train`): the module runs as `__main__` with the
    argv, sys.path[0], working directory, environment, streams and exit status a plain `python -m` gives it (the
    control, run the same way), but as a child of the server that imported torch."""
    if driver_fork_server is None:
        pytest.fail("HYBRIDRL_TEST_PLAIN_WORKERS=1: this session runs no fork server to test")
    (tmp_path / "probe.py").write_text(PROBE)
    env = {**os.environ, "MINE": "the driver's own"}
    args = ["-m", "probe", "two words", "--flag"]

    def run(command_env: dict[str, str]) -> dict:
        done = subprocess.run(python_command(args, command_env), cwd=tmp_path, env=command_env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 3 and done.stderr == "to stderr\n", (done.returncode, done.stderr[-3000:])
        return json.loads(done.stdout)

    forked = run(env)
    plain = run(plain_interpreters(env))
    assert (forked.pop("parent"), forked.pop("torch")) == (driver_fork_server.process.pid, True)
    assert (plain.pop("parent"), plain.pop("torch")) == (os.getpid(), False)
    assert forked == plain == {"argv": [str(tmp_path / "probe.py"), "two words", "--flag"], "path0": str(tmp_path),
                               "cwd": str(tmp_path), "name": "__main__", "mine": "the driver's own"}
