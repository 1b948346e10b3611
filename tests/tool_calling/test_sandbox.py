"""The python tool's operating-system sandbox against real escape attempts.

Each attack is model-written code sent through `build_registry(["python"])` the way the agent loop
calls it, from a separate caller process that holds secrets (an environment variable, a file in its
HOME, a file in its run folder) and is a child subreaper (so a process the attack leaves behind is
still found as its descendant). The effects are checked from outside: a file written outside, a
connection reaching a listener on 127.0.0.1, a secret in the observation, a process left running, the
caller killed.

Most attacks first disable the audit hook, from inside, the way hostile code would (its policy lives
in globals the code can reach): the kernel must hold without it. The same attacks under
``isolation="none"`` (the hook-only sandbox hybridrl had before) escape: that is the negative control.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from hybridrl.tool_calling import SandboxLimits, ToolStatus, run_sandboxed, sandbox_problem
from hybridrl.tool_calling.sandbox import (
    MAX_THREADS,
    REFUSED_SYSCALLS,
    TMPFS_FILES,
    bwrap_argv,
    cgroup_parent,
    pids_cgroup_parent,
)

ROOT = Path(__file__).resolve().parents[2]

# The caller: a separate process with secrets, calling the tool as the agent loop does, then listing
# the processes it (as a subreaper) still has under it, and killing them.
CALLER = r'''
import ctypes, json, os, signal, sys, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
from hybridrl.tool_calling import SandboxLimits, build_registry
from hybridrl.tool_calling.parsing import ToolCall
limits = SandboxLimits(wall_time_s=float(sys.argv[2]), cpu_time_s=3, memory_mb=512, max_file_mb=16)
registry = build_registry(["python"], sandbox=limits, isolation=sys.argv[1], max_observation_chars=100_000)
code = sys.stdin.read()
observation = registry.execute(ToolCall("python", {"code": code}, 0))
time.sleep(0.3)  # what the attack started has time to show itself

def descendants():
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                status = open(f"/proc/{entry}/status").read()
            except OSError:
                continue
            if status.split("State:")[1].split()[0] == "Z":
                continue  # exited (bwrap's own processes, reparented here to be reaped)
            ppid = int(status.split("PPid:")[1].split()[0])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found

left = descendants()
for pid in left:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
print(json.dumps({"status": observation.status.value, "text": observation.text, "left_running": len(left)}))
'''


@dataclass
class Outcome:
    caller_returncode: int
    status: str | None
    text: str
    left_running: int
    written_outside: bool
    connected: bool
    secrets_seen: list[str]


@pytest.fixture
def world(tmp_path):
    """The trainer's side of the machine: its secrets, a folder outside, a loopback listener."""
    home, run, outside = tmp_path / "home", tmp_path / "run", tmp_path / "outside"
    for folder in (home, run, outside):
        folder.mkdir()
    values = {name: f"{name}-{secrets.token_hex(8)}" for name in ("env", "home", "run")}
    (home / ".netrc").write_text(f"machine api.wandb.ai login user password {values['home']}\n")
    (run / "secret.txt").write_text(values["run"])
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    yield {"home": home, "run": run, "outside": outside, "secrets": values, "listener": listener,
           "port": listener.getsockname()[1], "target": outside / "escaped.txt"}
    listener.close()


def attack(world, code: str, isolation: str, wall_time_s: float = 20.0) -> Outcome:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(world["home"]),
           "HYBRIDRL_TEST_SECRET": world["secrets"]["env"], "PYTHONPATH": str(ROOT)}
    caller = subprocess.Popen([sys.executable, "-c", CALLER, isolation, str(wall_time_s)], cwd=world["run"], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    filled = textwrap.dedent(code).format(caller=caller.pid, target=world["target"], port=world["port"],
                                          home=world["home"], run=world["run"])
    out, err = caller.communicate(filled, timeout=120)
    try:
        world["listener"].accept()[0].close()
        connected = True
    except BlockingIOError:
        connected = False
    result = json.loads(out.strip().splitlines()[-1]) if caller.returncode == 0 else {}
    text = result.get("text", "") + out
    return Outcome(caller.returncode, result.get("status"), result.get("text", err), result.get("left_running", 0),
                   world["target"].exists(), connected,
                   [name for name, value in world["secrets"].items() if value in text])


# Disable the audit hook from inside: its policy is the bootstrap's globals, reached through
# __main__; the `gc` variant finds the hook function itself among all objects and replaces its code.
TAMPER = """
import sys
policy = sys.modules["__main__"].__dict__
policy.update(root="/", inside=lambda path: True, PROCESS=(), NO_IMPORT=(), own_proc=("/",))
"""
TAMPER_GC = """
import gc
hook = next(o for o in gc.get_objects() if getattr(o, "__name__", "") == "hook" and hasattr(o, "__code__"))
hook.__code__ = (lambda event, args: None).__code__
"""

# name -> (code after the tamper prelude, what the attack is after)
ESCAPES = {
    "write_outside": (TAMPER + "open('{target}', 'w').write('escaped')", "written_outside"),
    "write_outside_gc": (TAMPER_GC + "open('{target}', 'w').write('escaped')", "written_outside"),
    "read_home": ("print(open('{home}/.netrc').read())", "home"),  # the hook never refused reading
    "read_run_folder": ("print(open('{run}/secret.txt').read())", "run"),
    "read_caller_environ": (TAMPER + "print(open('/proc/{caller}/environ', 'rb').read())", "env"),
    "read_parent_environ": (TAMPER + "import os\nprint(open(f'/proc/{{os.getppid()}}/environ', 'rb').read())",
                            "env"),
    "connect_with_ctypes": (TAMPER_GC + """
import ctypes, socket, struct
libc = ctypes.CDLL(None)
fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
address = struct.pack("<HH4s8x", socket.AF_INET, socket.htons({port}), socket.inet_aton("127.0.0.1"))
print("connect:", libc.connect(fd, address, len(address)))
""", "connected"),
    "subprocess": (TAMPER + "import subprocess\nsubprocess.run(['/bin/sh', '-c', 'echo escaped > {target}'])",
                   "written_outside"),
    "fork_and_stay": (TAMPER_GC + """
import os, time
if os.fork() == 0:
    os.setsid()
    time.sleep(60)
print("forked")
""", "left_running"),
    "kill_caller_with_os_kill": (TAMPER + "import os\nos.kill({caller}, 9)", "caller_killed"),
    "kill_caller_with_ctypes": (TAMPER_GC + "import ctypes\nctypes.CDLL(None).kill({caller}, 9)", "caller_killed"),
}


def escaped(outcome: Outcome, goal: str) -> bool:
    if goal == "written_outside":
        return outcome.written_outside
    if goal == "connected":
        return outcome.connected
    if goal == "left_running":
        return outcome.left_running > 0
    if goal == "caller_killed":
        return outcome.caller_returncode == -signal.SIGKILL
    return goal in outcome.secrets_seen


def contained(outcome: Outcome) -> bool:
    return (outcome.caller_returncode == 0 and not outcome.written_outside and not outcome.connected
            and outcome.left_running == 0 and outcome.secrets_seen == [])


# CI (.ci/run) sets HYBRIDRL_REQUIRE_SANDBOX=1: there a machine without namespaces fails these tests rather
# than skipping them; elsewhere (a laptop in a locked-down container) they are skipped, saying why.
if os.environ.get("HYBRIDRL_REQUIRE_SANDBOX") == "1" and sandbox_problem() is not None:
    raise RuntimeError(f"HYBRIDRL_REQUIRE_SANDBOX=1 but {sandbox_problem()}")
needs_namespaces = pytest.mark.skipif(sandbox_problem() is not None,
                                      reason=f"no namespace sandbox here: {sandbox_problem()}")


@needs_namespaces
@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_escape_attempts_are_contained(world, name):
    code, goal = ESCAPES[name]
    outcome = attack(world, code, "namespaces")
    assert contained(outcome), (name, outcome)
    assert not escaped(outcome, goal)
    assert outcome.status in {s.value for s in ToolStatus}


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_the_hook_only_sandbox_does_not_hold(world, name):
    """The negative control: without namespaces (hybridrl's sandbox before) every attack gets what it is after."""
    code, goal = ESCAPES[name]
    outcome = attack(world, code, "none")
    if goal == "left_running" and pids_cgroup_parent() is not None:
        # where the run gets a cgroup of its own, what it leaves running is killed with it, namespaces or not
        assert contained(outcome) and outcome.text == "forked\n", (name, outcome)
        return
    assert escaped(outcome, goal), (name, outcome)


# Attacks on the machine rather than on secrets: contained by the kernel's limits (and, for the fork
# bomb, the seccomp filter). Not run without namespaces: there a fork bomb would take the test machine.
RESOURCE_ATTACKS = {
    "fork_bomb": (TAMPER + """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
""", {"timeout"}),
    "memory_bomb": ("chunks = []\nwhile True:\n    chunks.append(bytearray(64 << 20))", {"tool_error"}),
    "one_gigabyte_write": ("with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(bytes(1 << 20))",
                           {"tool_error"}),
    "one_gigabyte_in_tmp": ("for i in range(64):\n    open(f'/tmp/part{{i}}', 'wb').write(bytes(16 << 20))",
                            {"tool_error"}),
    "endless_loop": ("while True:\n    pass", {"timeout"}),
    "threads_sleeping_forever": ("import threading, time\nfor _ in range(4):\n"
                                 "    threading.Thread(target=time.sleep, args=(600,)).start()", {"timeout"}),
}


@needs_namespaces
@pytest.mark.parametrize("name", sorted(RESOURCE_ATTACKS))
def test_attacks_on_the_machine_are_contained(world, name):
    code, statuses = RESOURCE_ATTACKS[name]
    start = time.perf_counter()
    outcome = attack(world, code, "namespaces", wall_time_s=4)
    assert contained(outcome), (name, outcome)
    assert outcome.status in statuses, (name, outcome)
    assert time.perf_counter() - start < 60


@needs_namespaces
def test_what_the_program_sees():
    code = """
import os, socket
print(os.getuid(), os.getpid(), sorted(os.environ))
print(sorted(p for p in os.listdir('/proc') if p.isdigit()))
print(open('/proc/self/status').read().split('NoNewPrivs:')[1].split()[0],
      open('/proc/self/status').read().split('Seccomp:')[1].split()[0],
      open('/proc/self/status').read().split('CapEff:')[1].split()[0])
print(sorted(socket.if_nameindex()))
print(os.path.exists(os.path.expanduser('~root/.cache')), os.path.exists('/etc/passwd'))
"""
    run = run_sandboxed([sys.executable, "-I", "-c", code], limits=SandboxLimits(wall_time_s=30),
                        env={"EXTRA": "1"})
    lines = run.stdout.splitlines()
    assert run.status is ToolStatus.OK, run.stderr
    assert lines[0] == "65534 2 ['EXTRA', 'HOME', 'LANG', 'PATH', 'PWD', 'PYTHONDONTWRITEBYTECODE', " \
                       "'PYTHONIOENCODING', 'TMPDIR']"
    assert lines[1] == "['1', '2']"  # bwrap's init and the program: nothing of the host
    assert lines[2] == "1 2 0000000000000000"  # no new privileges, a seccomp filter, no capabilities
    assert lines[3] == "[(1, 'lo')]"  # an empty network namespace
    assert lines[4] == "False False"


@needs_namespaces
@pytest.mark.parametrize("call", [
    "libc.ptrace(16, 1, 0, 0)",  # PTRACE_ATTACH
    "libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)",
    "libc.unshare(0x10000000)",  # CLONE_NEWUSER
    "libc.syscall(321, 0, 0, 0)",  # bpf
    "libc.syscall(298, 0, 0, -1, -1, 0)",  # perf_event_open
    "libc.syscall(250, 0, 0, 0)",  # keyctl
    "libc.syscall(425, 1, 0)",  # io_uring_setup
    # AF_VSOCK: a network namespace does not hold it; in a virtual machine it reaches the host (CID 2)
    "libc.socket(40, 1, 0)",
    "libc.socket(38, 5, 0)",  # AF_ALG (the kernel's crypto API)
    "libc.socket(17, 3, 0)",  # AF_PACKET
    "libc.socket(200, 1, 0)",  # past the kernel's families
])
def test_the_filter_refuses_what_no_program_needs(call):
    code = f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint({call}, ctypes.get_errno())"
    run = run_sandboxed([sys.executable, "-I", "-c", code], limits=SandboxLimits(wall_time_s=30))
    assert (run.status, run.stdout) == (ToolStatus.OK, "-1 1\n"), run.stderr  # EPERM


def test_the_refused_list_names_real_syscalls():
    import pyseccomp

    unknown = [n for n in REFUSED_SYSCALLS if pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, n) < 0]
    assert unknown == []  # x86_64 has them all: a misspelt name would be skipped silently
    argv = bwrap_argv(["true"], SandboxLimits(), 3, {}, {})
    for flag in ("--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
                 "--clearenv"):
        assert flag in argv
    assert argv[argv.index("--cap-drop") + 1] == "ALL" and argv[argv.index("--seccomp") + 1] == "3"
    assert "--bind" not in argv and str(Path.home()) not in argv  # nothing of the host is writable


@needs_namespaces
def test_files_in_and_a_program_of_the_users():
    script = "cat data/in.txt; echo more >> data/in.txt; cat data/in.txt | wc -l"
    run = run_sandboxed(["/bin/sh", "-c", script], files={"data/in.txt": b"hello\n"},
                        limits=SandboxLimits(wall_time_s=30), max_processes=4)
    assert (run.status, run.stdout) == (ToolStatus.OK, "hello\n2\n"), run.stderr
    # without processes allowed, the shell cannot start `cat`: the filter refuses fork
    refused = run_sandboxed(["/bin/sh", "-c", script], files={"data/in.txt": b"hello\n"},
                            limits=SandboxLimits(wall_time_s=30))
    assert refused.status is ToolStatus.TOOL_ERROR and "fork" in refused.stderr.lower()
    with pytest.raises(ValueError, match="relative path"):
        run_sandboxed(["true"], files={"../x": b""})


@needs_namespaces
@pytest.mark.skipif(pids_cgroup_parent() is None, reason="no writable pids cgroup here")
def test_a_fork_bomb_with_processes_allowed_meets_the_pids_cgroup():
    bomb = "import os, time\nn = 0\nwhile True:\n    try:\n        os.fork(); n += 1\n    except OSError:\n" \
           "        print('refused after', n, flush=True); time.sleep(60)"
    start = time.perf_counter()
    run = run_sandboxed([sys.executable, "-I", "-c", bomb], limits=SandboxLimits(wall_time_s=3), max_processes=8)
    assert run.status is ToolStatus.TIMEOUT and "refused after" in run.stdout
    assert time.perf_counter() - start < 30
    # this process's runs' cgroups are gone (others on the machine may be running theirs)
    ours = f"hybridrl-sandbox-{os.getpid()}-"
    for controller in ("pids", "memory"):
        parent = cgroup_parent(controller)
        assert parent is None or [p for p in os.listdir(parent) if p.startswith(ours)] == []


@needs_namespaces
def test_the_documented_user_tool_runs_the_models_code_in_the_sandbox(world):
    """configs/examples/sandboxed_tools.py (the user guide's example): a tools-file tool that runs the model's
    solution and the row's tests with `run_sandboxed`, called as the agent loop calls it."""
    from hybridrl.tool_calling import build_registry
    from hybridrl.tool_calling.parsing import ToolCall

    registry = build_registry(["run_tests"], tools_file=ROOT / "configs/examples/sandboxed_tools.py")
    row = {"extra_info": {"tests": "assert solution.add(2, 3) == 5"}}

    def call(solution: str):
        return registry.execute(ToolCall("run_tests", {"solution": solution}, 0), row)

    assert (call("def add(a, b):\n    return a + b").text) == "all tests passed\n"
    wrong = call("def add(a, b):\n    return a - b")
    assert wrong.status is ToolStatus.TOOL_ERROR and "AssertionError" in wrong.text
    snooping = call(f"print(open({str(world['home'] / '.netrc')!r}).read())")
    assert "FileNotFoundError" in snooping.text and world["secrets"]["home"] not in snooping.text


@needs_namespaces
def test_the_tool_runs_sandboxed_inside_a_ray_worker(ray_cluster, world):
    """Where the agent loop really runs it: a Ray worker process (with Ray's own environment and sockets)
    builds the registry from a job's multi_turn section and runs an attack; the worker survives it."""
    import ray

    from hybridrl.config.schema import MultiTurnConfig

    @ray.remote(num_cpus=0)
    def call_in_worker(code: str) -> tuple[str, str, int]:
        from hybridrl.rollout.agent_loop import build_agent_loop  # noqa: F401  (the loop's import path)
        from hybridrl.tool_calling import build_registry
        from hybridrl.tool_calling.parsing import ToolCall

        registry = build_registry(["python"], isolation=MultiTurnConfig().sandbox.isolation)
        code = code.replace("WORKER_PID", str(os.getpid()))  # the attack aims at this very worker
        observation = registry.execute(ToolCall("python", {"code": code}, 0))
        return observation.status.value, observation.text, os.getpid()

    code = TAMPER_GC + textwrap.dedent(f"""
        import os, ctypes
        print(sorted(os.environ))
        print(os.path.exists('/tmp/ray'), os.path.exists({str(world['home'])!r}))
        print(ctypes.CDLL(None).kill(os.getppid(), 9), ctypes.CDLL(None).kill(WORKER_PID, 9))
        """)
    status, text, pid = ray.get(call_in_worker.remote(code), timeout=120)
    lines = text.splitlines()
    assert status == "ok", text
    assert not any(name.startswith("RAY") for name in eval(lines[0]))
    assert lines[1] == "False False"  # Ray's session folder and the trainer's files are not there
    # the Ray worker's pid does not exist in the sandbox's PID namespace (-1, ESRCH); its parent there is
    # the namespace's own init (bwrap's), which the kernel shields from SIGKILL sent from inside
    assert lines[2].split()[1] == "-1"
    os.kill(pid, 0)  # the worker that ran the tool lives on (ProcessLookupError otherwise)


@needs_namespaces
def test_a_virtual_environment_reached_through_a_symlinked_folder_runs_the_python_tool(tmp_path):
    """A venv whose folder is a symlink (`~/.venv -> /data/envs/x`, a worktree's venv link): the sandbox binds the
    real folders, so it must start `sys.executable` by a path that exists in there (the folders resolved, the
    venv's own `python` kept so that its site-packages are found). Was: "bwrap: execvp <link>/bin/python: No such
    file or directory", and `plan` refused the python tool on a machine where the sandbox works."""
    prefix = Path(sys.prefix)
    if prefix == Path(sys.base_prefix):
        pytest.fail("the tests run from a virtual environment (make venv); this one is the base interpreter")
    link = tmp_path / "venv-link"
    link.symlink_to(prefix.resolve(), target_is_directory=True)
    program = ("from hybridrl.tool_calling import SandboxLimits, run_sandboxed, sandbox_problem\n"
               "import sys\n"
               "print(sandbox_problem())\n"
               "run = run_sandboxed([sys.executable, '-I', '-c', 'import sys, megatron; print(sys.prefix)'],\n"
               "                    limits=SandboxLimits(wall_time_s=60, memory_mb=2048))\n"
               "print(run.stdout.strip() or run.stderr.strip()[-300:])\n")
    done = subprocess.run([str(link / "bin" / Path(sys.executable).name), "-c", program], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    problem, prefix_inside = done.stdout.strip().splitlines()
    assert problem == "None"
    assert Path(prefix_inside) == prefix.resolve()  # the venv itself (its packages importable), not the base


# Memory the address-space limit does not count, and tasks: bounded by the kernel's tmpfs sizes and the run's
# cgroups. Each was an attack that worked: 640 MB in /dev/shm (bwrap's /dev tmpfs has no size), 1.6 GB held in
# memfd files, 800 threads (each a PID of the host's) under a 512 MB address-space limit.
DEV_SHM = TAMPER + """
written = 0
try:
    for i in range(64):
        with open(f'/dev/shm/part{{i}}', 'wb') as f:
            f.write(bytes(16 << 20))
        written += 16
except OSError as error:
    print('stopped:', error.strerror)
print('MB written', written, flush=True)
"""
MEMFD = """
import os
held = []
for i in range(64):
    fd = os.memfd_create(f'part{{i}}')
    os.write(fd, bytes(16 << 20))
    held.append(fd)
    print('MB held', 16 * len(held), flush=True)
"""
THREADS = """
import threading, time
threading.stack_size(32768)
started = 0
try:
    while True:
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        started += 1
except RuntimeError:
    pass
print('threads', started, flush=True)
"""


@needs_namespaces
def test_dev_shm_is_a_tmpfs_of_the_sandboxs_size(world):
    outcome = attack(world, DEV_SHM, "namespaces")
    assert contained(outcome), outcome
    assert "stopped: No space left on device" in outcome.text, outcome
    assert f"MB written {TMPFS_FILES * 16}\n" in outcome.text  # the caller's max_file_mb is 16


@needs_namespaces
@pytest.mark.skipif(cgroup_parent("memory") is None, reason="no writable memory cgroup here")
def test_memory_held_in_memfd_files_meets_the_memory_cgroup(world):
    """1 GB in memfd files, twice the caller's 512 MB limit: the memory cgroup's limit (the address space plus the
    tmpfs folders, 704 MB) kills the program, and the observation says it was memory."""
    outcome = attack(world, MEMFD, "namespaces")
    assert contained(outcome), outcome
    held = [int(line.split()[-1]) for line in outcome.text.splitlines() if line.startswith("MB held")]
    assert 512 <= max(held) <= 512 + 3 * TMPFS_FILES * 16
    assert outcome.status == "tool_error" and "[tool_error: memory limit of 512 MB" in outcome.text, outcome


@needs_namespaces
@pytest.mark.skipif(pids_cgroup_parent() is None, reason="no writable pids cgroup here")
def test_threads_meet_the_pids_cgroup(world):
    outcome = attack(world, THREADS, "namespaces")
    assert contained(outcome) and outcome.status == "ok", outcome
    started = int(outcome.text.split("threads")[1].split()[0])
    # bwrap (outside and its init inside) and the program's main thread are counted too
    assert started == MAX_THREADS - 3, outcome.text
