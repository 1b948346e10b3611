"""The built-in ``python`` tool: model-written code run in the operating-system sandbox.

Each call is one fresh Python process in `hybridrl.tool_calling.sandbox` (namespaces, a seccomp filter,
kernel limits; read there what it guarantees): the code arrives on stdin, its stdout and stderr come
back as the observation, with why it stopped when it did not end normally (a limit, an exception).

Inside, before the model's code runs, a Python audit hook (``sys.addaudithook``) refuses sockets,
writing outside its folder, starting or signalling processes, ``ctypes`` and other processes' /proc
entries. The hook is a second layer that turns honest mistakes into clear errors; it is not a
security boundary against hostile code (code can reach the hook's state), and nothing relies on it:
with ``isolation: "namespaces"`` the kernel holds every line above. With ``isolation: "none"`` (the
explicit opt-out) the hook and the kernel limits are all there is.
"""
from __future__ import annotations

import sys
from collections.abc import Callable

from hybridrl.tool_calling.registry import ToolResult, ToolStatus
from hybridrl.tool_calling.sandbox import Isolation, SandboxLimits, SandboxRun, require_sandbox, run_sandboxed

# Runs in the child before the model's code: the hook (which the code cannot remove; audit hooks
# cannot be). The kernel limits were set before the interpreter started. The code arrives on stdin.
_BOOTSTRAP = r'''
import os, resource, sys
root = os.path.realpath(os.getcwd())
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


def run_python(code: str, limits: SandboxLimits | None = None, isolation: Isolation = "namespaces") -> SandboxRun:
    """Run `code` in a fresh sandboxed Python and say how it ended."""
    return run_sandboxed([sys.executable, "-I", "-c", _BOOTSTRAP], stdin=code.encode("utf-8", errors="replace"),
                         limits=limits, isolation=isolation)


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


def python_tool(limits: SandboxLimits | None = None,
                isolation: Isolation = "namespaces") -> Callable[[str], ToolResult]:
    """The tool function with `limits` fixed: code in, the run's output (and why it stopped) out.
    Refuses (`SandboxUnavailable`) to make a namespaced tool where the kernel cannot give one."""
    if isolation == "namespaces":
        require_sandbox()

    def python(code: str) -> ToolResult:
        run = run_python(code, limits, isolation)
        text = run.stdout + (("\n" if run.stdout and not run.stdout.endswith("\n") else "") + run.stderr
                             if run.stderr else "")
        if run.status is not ToolStatus.OK:
            text += f"\n[{run.status.value}: {run.reason}]"
        return ToolResult(text, run.status)

    return python
