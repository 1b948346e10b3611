"""The built-in ``python`` tool: model-written code run in a limited subprocess.

What the sandbox guarantees, for code that stays in Python (the model's code as written):
  * its own fresh temporary directory as the working directory (also HOME and TMPDIR), removed after
    the run whatever happened;
  * a wall-time limit (the whole process group is killed), a CPU-time limit (RLIMIT_CPU), an
    address-space limit (RLIMIT_AS: a large allocation is a MemoryError), a file-size limit
    (RLIMIT_FSIZE) and, where the OS applies it (not to root), no new processes (RLIMIT_NPROC 0);
  * stdout and stderr cut to `SandboxLimits.max_output_bytes` each (the rest read and dropped);
  * an environment of its own: nothing of the trainer's variables (API keys, tokens) is passed, and
    the interpreter runs isolated (``-I``: no PYTHON* variables, no user site, no script directory);
  * an audit hook (``sys.addaudithook``), installed before the model's code runs, that refuses every
    ``socket.*`` event (no connect, bind, DNS lookup), opening a file for writing and removing,
    renaming, linking or changing files outside its directory, starting processes (fork, exec,
    spawn, subprocess, os.system, and importing ``_posixsubprocess``), importing ``ctypes``, and reading
    other processes' /proc entries (the trainer's environment among them).

What it does NOT guarantee: it is not a security boundary against hostile native code. Code that
loads a C extension or uses ctypes can bypass an audit hook, and a process running as root may raise
its own limits again. It can read every file the trainer's user can read (only /proc of other
processes is refused). For untrusted code at scale, run the trainer in a container or VM without
network; this tool keeps honest mistakes (an endless loop, a huge print, a stray write) from harming
a training step.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from hybridrl.tools.registry import ToolResult, ToolStatus


@dataclass(frozen=True)
class SandboxLimits:
    wall_time_s: float = 10.0
    cpu_time_s: int = 5
    memory_mb: int = 512
    max_file_mb: int = 16
    max_output_bytes: int = 8192

    def __post_init__(self) -> None:
        for name in ("wall_time_s", "cpu_time_s", "memory_mb", "max_file_mb", "max_output_bytes"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}")


# Runs in the child before the model's code: limits first, then the hook (after the hook the code
# cannot undo it: audit hooks cannot be removed). The code itself arrives on stdin.
_BOOTSTRAP = r'''
import os, resource, sys
root = os.path.realpath(os.getcwd())
cpu, memory, fsize = (int(v) for v in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
try:
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
except (ValueError, OSError):
    pass
code = sys.stdin.read()
sys.stdin = open(os.devnull)
own_proc = ("/proc/self", "/proc/thread-self", f"/proc/{os.getpid()}")
PROCESS = ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen",
           "pty.spawn", "os.kill", "os.killpg")
PATHS = {"os.remove": (0,), "os.rename": (0, 1), "os.rmdir": (0,), "os.mkdir": (0,), "os.symlink": (0, 1),
         "os.link": (0, 1), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
         "shutil.rmtree": (0,), "os.chdir": (0,)}
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
realpath, fspath, isinstance_, str_, bytes_ = os.path.realpath, os.fspath, isinstance, str, bytes

def inside(path):
    if isinstance_(path, int):
        return True  # an already open descriptor
    full = realpath(fspath(path) if not isinstance_(path, bytes_) else fspath(path).decode(errors="replace"))
    return full == root or full.startswith(root + "/")

# Modules that reach processes or native memory without an audit event of their own; an ImportError
# (not PermissionError) so libraries that treat them as optional still import.
NO_IMPORT = ("_posixsubprocess", "ctypes", "_ctypes")

def hook(event, args):
    if event == "import":
        if args[0] in NO_IMPORT or args[0].startswith("ctypes."):
            raise ImportError(f"sandbox: module {args[0]} is not available")
        return
    if event.startswith("socket."):
        raise PermissionError(f"sandbox: no network ({event})")
    if event in PROCESS:
        raise PermissionError(f"sandbox: no processes started or signalled ({event})")
    if event == "open":
        path, mode, flags = args
        if path is None or isinstance_(path, int):
            return
        text = fspath(path)
        text = text.decode(errors="replace") if isinstance_(text, bytes_) else text
        full = realpath(text)
        if full.startswith("/proc/") and not full.startswith(own_proc):
            raise PermissionError(f"sandbox: {text} is another process's")
        writing = (mode is not None and any(c in str_(mode) for c in "wax+")) or (flags or 0) & WRITE
        if writing and not inside(text):
            raise PermissionError(f"sandbox: writing {text} outside its directory is refused")
        return
    if event in PATHS:
        for i in PATHS[event]:
            if i < len(args) and args[i] is not None and not inside(args[i]):
                raise PermissionError(f"sandbox: {event} on {args[i]} outside its directory is refused")

sys.addaudithook(hook)
del hook
exec(compile(code, "<tool code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
'''


@dataclass(frozen=True)
class SandboxRun:
    stdout: str
    stderr: str
    returncode: int | None  # None: killed at the wall-time limit
    status: ToolStatus
    reason: str  # "" when ok; else what happened, in words
    seconds: float


class _CappedReader(threading.Thread):
    """Keeps the first `limit` bytes of a pipe and drains the rest (a full pipe would stall the child)."""

    def __init__(self, stream, limit: int) -> None:  # type: ignore[no-untyped-def]
        super().__init__(daemon=True)
        self.stream, self.limit, self.kept, self.total = stream, limit, bytearray(), 0

    def run(self) -> None:
        while chunk := self.stream.read(65536):
            self.total += len(chunk)
            room = self.limit - len(self.kept)
            if room > 0:
                self.kept += chunk[:room]


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxRun:
    """Run `code` in the sandbox (see the module docstring) and say how it ended."""
    limits = limits or SandboxLimits()
    workdir = tempfile.mkdtemp(prefix="hybridrl-sandbox-")
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
    argv = [sys.executable, "-I", "-c", _BOOTSTRAP, str(int(limits.cpu_time_s)),
            str(int(limits.memory_mb) << 20), str(int(limits.max_file_mb) << 20)]
    start = time.perf_counter()
    try:
        process = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
        readers = [_CappedReader(process.stdout, limits.max_output_bytes),
                   _CappedReader(process.stderr, limits.max_output_bytes)]
        for reader in readers:
            reader.start()
        try:
            assert process.stdin is not None
            process.stdin.write(code.encode("utf-8", errors="replace"))
            process.stdin.close()
        except BrokenPipeError:
            pass  # the child died before reading; its stderr says why
        timed_out = False
        try:
            process.wait(timeout=limits.wall_time_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for reader in readers:
            reader.join(timeout=5)
        seconds = time.perf_counter() - start
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out, err = (r.kept.decode("utf-8", errors="replace") for r in readers)
    code_ = None if timed_out else process.returncode
    truncated = [name for name, r in zip(("stdout", "stderr"), readers) if r.total > limits.max_output_bytes]
    if timed_out:
        return SandboxRun(out, err, None, ToolStatus.TIMEOUT, f"wall-time limit of {limits.wall_time_s} s", seconds)
    if code_ in (-signal.SIGXCPU, -signal.SIGKILL) and "MemoryError" not in err:
        return SandboxRun(out, err, code_, ToolStatus.TIMEOUT, f"CPU-time limit of {limits.cpu_time_s} s", seconds)
    if code_ == -signal.SIGXFSZ:
        return SandboxRun(out, err, code_, ToolStatus.TOOL_ERROR, f"file-size limit of {limits.max_file_mb} MB",
                          seconds)
    if code_ != 0:
        # Python ignores SIGXFSZ, so the file-size limit surfaces as EFBIG in the child's traceback.
        reason = (f"memory limit of {limits.memory_mb} MB" if "MemoryError" in err
                  else f"file-size limit of {limits.max_file_mb} MB" if "[Errno 27] File too large" in err
                  else f"exit status {code_}")
        return SandboxRun(out, err, code_, ToolStatus.TOOL_ERROR, reason, seconds)
    if truncated:
        return SandboxRun(out, err, code_, ToolStatus.OUTPUT_TRUNCATED,
                          f"{' and '.join(truncated)} cut to {limits.max_output_bytes} bytes", seconds)
    return SandboxRun(out, err, code_, ToolStatus.OK, "", seconds)


SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code and see what it prints (no network, no files outside its folder).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the Python program; print the results"}},
            "required": ["code"],
        },
    },
}


def python_tool(limits: SandboxLimits | None = None):  # type: ignore[no-untyped-def]
    """The tool function with `limits` fixed: code in, the run's output (and why it stopped) out."""

    def python(code: str) -> ToolResult:
        run = run_python(code, limits)
        text = run.stdout + (("\n" if run.stdout and not run.stdout.endswith("\n") else "") + run.stderr
                             if run.stderr else "")
        if run.status is not ToolStatus.OK:
            text += f"\n[{run.status.value}: {run.reason}]"
        return ToolResult(text, run.status)

    return python
