"""The python sandbox: each limit is hit for real in a child process, and each one ends as its own status."""
from __future__ import annotations

import glob
import os
import signal
import socket
import tempfile

import pytest

from hybridrl.tool_calling import SandboxLimits, ToolStatus, run_python

# generous wall time: the machine is shared, and only the tests of the wall limit itself need it short
FAST = SandboxLimits(wall_time_s=30, cpu_time_s=2, memory_mb=256, max_output_bytes=1000)


def test_prints_the_result():
    run = run_python("import math\nprint(sum(i * i for i in range(10)), math.factorial(5))", FAST)
    assert (run.stdout, run.stderr, run.returncode, run.status) == ("285 120\n", "", 0, ToolStatus.OK)


def test_an_exception_is_a_tool_error_with_its_traceback():
    run = run_python("print('before')\n1 / 0", FAST)
    assert run.status is ToolStatus.TOOL_ERROR and run.returncode == 1 and run.stdout == "before\n"
    assert run.stderr.strip().endswith("ZeroDivisionError: division by zero")


def test_wall_time_limit():
    run = run_python("import time\nprint('start', flush=True)\ntime.sleep(60)", SandboxLimits(wall_time_s=1))
    assert run.status is ToolStatus.TIMEOUT and run.returncode is None and run.stdout == "start\n"
    assert run.reason == "wall-time limit of 1 s" and run.seconds < 10


def test_cpu_time_limit():
    run = run_python("while True:\n    pass", SandboxLimits(wall_time_s=30, cpu_time_s=1))
    assert run.status is ToolStatus.TIMEOUT and run.reason == "CPU-time limit of 1 s"
    assert run.returncode == 128 + signal.SIGXCPU  # killed by SIGXCPU (bwrap's 128 + N), not by the wall clock
    assert run.seconds < 20


def test_memory_limit():
    run = run_python("x = bytearray(1 << 30)\nprint('allocated')", FAST)
    assert run.status is ToolStatus.TOOL_ERROR and run.reason == "memory limit of 256 MB"
    assert "MemoryError" in run.stderr and run.stdout == ""


def test_file_size_limit():
    run = run_python("open('small', 'wb').write(b'x' * 1000)\nopen('big', 'wb').write(b'x' * (3 << 20))",
                     SandboxLimits(wall_time_s=30, max_file_mb=1))
    assert run.status is ToolStatus.TOOL_ERROR and run.reason == "file-size limit of 1 MB"
    assert run.stderr.strip().splitlines()[-1] == "OSError: [Errno 27] File too large"


def test_output_truncated():
    run = run_python("print('x' * 100_000)\nprint('tail')", FAST)
    assert run.status is ToolStatus.OUTPUT_TRUNCATED and run.stdout == "x" * 1000
    assert run.reason == "stdout cut to 1000 bytes"


def test_cannot_write_outside_its_directory(tmp_path):
    target = tmp_path / "escape.txt"
    code = (f"open('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())\n"
            f"import os\nos.mkdir('sub')\nopen('sub/f', 'w').close()\n"
            f"try:\n    open({str(target)!r}, 'w')\nexcept PermissionError as e:\n    print('refused', e)\n"
            f"try:\n    os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)\nexcept PermissionError:\n"
            f"    print('os.open refused')\n"
            f"try:\n    open('../escape2.txt', 'a')\nexcept PermissionError:\n    print('parent refused')\n"
            f"try:\n    os.remove({str(tmp_path / 'keep')!r})\nexcept PermissionError:\n    print('remove refused')\n")
    (tmp_path / "keep").write_text("keep")
    run = run_python(code, FAST)
    assert run.status is ToolStatus.OK, run.stderr
    assert run.stdout.splitlines() == [
        "ok", f"refused sandbox: writing {target} outside its directory is refused", "os.open refused",
        "parent refused", "remove refused"]
    assert not target.exists() and (tmp_path / "keep").read_text() == "keep"


@pytest.mark.parametrize("action, event", [
    ("socket.socket().connect(('127.0.0.1', port))", "socket.__new__"),
    ("socket.socket().bind(('127.0.0.1', 0))", "socket.__new__"),
    ("socket.create_connection(('127.0.0.1', port))", "socket.getaddrinfo"),
    ("socket.getaddrinfo('localhost', port)", "socket.getaddrinfo"),
])
def test_cannot_open_a_socket(action, event):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        run = run_python(f"import socket\nport = {port}\n{action}\nprint('networked')", FAST)
        with pytest.raises(BlockingIOError):  # nobody connected to the listener
            listener.accept()
    finally:
        listener.close()
    assert run.status is ToolStatus.TOOL_ERROR and "networked" not in run.stdout
    assert run.stderr.strip().splitlines()[-1] == f"PermissionError: sandbox: no network ({event})"


@pytest.mark.parametrize("code, error", [
    ("import os\nos.fork()", "PermissionError: sandbox: no processes started or signalled (os.fork)"),
    ("import os\nos.execv('/bin/true', ['true'])",
     "PermissionError: sandbox: no processes started or signalled (os.exec)"),
    ("import os\nos.system('true')", "PermissionError: sandbox: no processes started or signalled (os.system)"),
    ("import os\nos.kill(os.getppid(), 9)", "PermissionError: sandbox: no processes started or signalled (os.kill)"),
    # the C module under subprocess starts processes without an audit event of its own
    ("import subprocess", "ImportError: sandbox: module _posixsubprocess is not available"),
    ("import ctypes", "ImportError: sandbox: module ctypes is not available"),
])
def test_cannot_start_a_process_or_load_native_code(code, error):
    run = run_python(code, FAST)
    assert run.status is ToolStatus.TOOL_ERROR
    assert run.stderr.strip().splitlines()[-1] == error


def test_ordinary_libraries_still_work():
    run = run_python("import numpy as np, json, fractions\n"
                     "print(int(np.arange(10).sum()), json.dumps([fractions.Fraction(1, 3) * 3 == 1]))", FAST)
    assert (run.status, run.stdout) == (ToolStatus.OK, "45 [true]\n")


def test_cannot_read_the_trainers_secrets(monkeypatch):
    monkeypatch.setenv("HYBRIDRL_TEST_SECRET", "s3cret-value")
    code = ("import os\nprint(os.environ.get('HYBRIDRL_TEST_SECRET'))\nprint(sorted(os.environ))\n"
            "try:\n    print(open(f'/proc/{os.getppid()}/environ', 'rb').read())\n"
            "except PermissionError:\n    print('parent environ refused')\n")
    run = run_python(code, FAST)
    assert run.status is ToolStatus.OK, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "None" and "s3cret-value" not in run.stdout
    assert lines[2] == "parent environ refused"
    assert "HYBRIDRL_TEST_SECRET" not in lines[1] and "PATH" in lines[1]


def test_its_folder_is_private_and_gone_after_the_run(tmp_path):
    # /sandbox is a tmpfs of the run's own mount namespace: a second run (or a timed-out one) finds nothing
    # of the first, and nothing of it is left on the host's disk
    first = run_python("import os\nprint(os.getcwd(), os.environ['HOME'])\nopen('f', 'w').write('x')\n"
                       "print(os.listdir('.'))", FAST)
    assert first.stdout == "/sandbox /sandbox\n['f']\n", first.stderr
    timed = run_python("import os\nprint(os.listdir('.'), flush=True)\nopen('g', 'w').write('y')\nwhile True: pass",
                       SandboxLimits(wall_time_s=1))
    assert timed.status is ToolStatus.TIMEOUT and timed.stdout == "[]\n"
    assert run_python("import os\nprint(os.listdir('.'))", FAST).stdout == "[]\n"


def test_the_opt_out_runs_in_a_temporary_folder_that_is_removed(monkeypatch, tmp_path):
    # A private temp root: another xdist worker's tools make their own sandboxes under /tmp meanwhile.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    run = run_python("import os\nprint(os.getcwd())\nopen('f', 'w').write('x')", FAST, isolation="none")
    workdir = run.stdout.strip()
    assert os.path.dirname(workdir) == str(tmp_path) and os.path.basename(workdir).startswith("hybridrl-sandbox-")
    assert not os.path.exists(workdir)
    timed = run_python("import os\nprint(os.getcwd(), flush=True)\nwhile True: pass", SandboxLimits(wall_time_s=1),
                       isolation="none")
    assert timed.status is ToolStatus.TIMEOUT and not os.path.exists(timed.stdout.strip())
    assert glob.glob(os.path.join(str(tmp_path), "hybridrl-sandbox-*")) == []


def test_limits_are_checked():
    with pytest.raises(ValueError, match=r"SandboxLimits.memory_mb must be a positive number, got 0"):
        SandboxLimits(memory_mb=0)
