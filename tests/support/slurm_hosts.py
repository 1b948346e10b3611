"""A Slurm cluster on network-namespace hosts (`tests.support.netns_hosts.Cluster`), to run launch/slurm_grpo.sbatch for
real: slurmctld on the first host, a slurmd on each, every daemon in a UTS namespace of its own so that its host
name is its node name (n0, n1, ...; `ip netns` shares the host name otherwise), munge for authentication (one
munged for the machine: its socket is a file, which the namespaces share). Debian's slurm-wlm 22.05 and munge
(`make system-deps`); root only. Process tracking by /proc and no task plugin: the hosts share one kernel's
cgroups, which slurmd must not carve up.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from tests.support.netns_hosts import Cluster

SLURM_PROGRAMS = ("slurmctld", "slurmd", "sbatch", "munged")
PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


def _run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess:
    """A system program, found on PATH's sbin folders too (a test's own PATH may lack them)."""
    return subprocess.run(argv, env={"PATH": PATH}, capture_output=True, **kwargs)  # type: ignore[call-overload]


def _munge_works() -> bool:
    encoded = _run(["munge", "-n"])
    return encoded.returncode == 0 and _run(["unmunge"], input=encoded.stdout).returncode == 0


@contextlib.contextmanager
def _munged() -> Iterator[None]:
    """munged running for the duration (the one already running, or one started here and stopped after)."""
    if _munge_works():
        yield
        return
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    if not Path("/etc/munge/munge.key").exists():
        _run(["mungekey", "--create"], check=True)
    _run(["munged", "--force"], check=True)  # as root: --force accepts that
    try:
        for _ in range(50):
            if _munge_works():
                break
            time.sleep(0.1)
        yield
    finally:
        _run(["pkill", "-x", "munged"])


def _cgroup_plugin() -> str:
    """cgroup/v2 on a unified hierarchy, else v1 (slurmd's autodetect reads a tmpfs of v1 controllers as none)."""
    kind = _run(["stat", "-fc", "%T", "/sys/fs/cgroup"], text=True).stdout.strip()
    return "cgroup/v2" if kind == "cgroup2fs" else "cgroup/v1"


def slurm_conf(cluster: Cluster, work: Path, cpus: int) -> str:
    head = cluster.hosts[0]
    nodes = "\n".join(f"NodeName=n{i} NodeAddr={host.address} CPUs={cpus} State=UNKNOWN"
                      for i, host in enumerate(cluster.hosts))
    return f"""ClusterName=hybridrl
SlurmctldHost=ctl({head.address})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={work}/state
SlurmdSpoolDir={work}/spool-%n
SlurmctldPidFile={work}/slurmctld.pid
SlurmdPidFile={work}/slurmd-%n.pid
SlurmctldLogFile={work}/slurmctld.log
SlurmdLogFile={work}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
{nodes}
PartitionName=cpu Nodes=n[0-{len(cluster.hosts) - 1}] Default=YES MaxTime=INFINITE State=UP
"""


@contextlib.contextmanager
def slurm_cluster(cluster: Cluster, work: Path, cpus: int = 2, start_timeout_s: float = 60) -> Iterator[dict[str, str]]:
    """slurmctld and a slurmd per host, every node idle; yields the environment sbatch and friends need
    (SLURM_CONF). Every daemon is stopped on leaving, also when the test failed."""
    missing = [p for p in SLURM_PROGRAMS if shutil.which(p, path=PATH) is None]
    if missing:
        raise RuntimeError(f"Slurm is not installed ({', '.join(missing)} missing): run `make system-deps` "
                           "(Debian's slurm-wlm and munge)")
    work.mkdir(parents=True, exist_ok=True)
    (work / "state").mkdir(exist_ok=True)
    for i in range(len(cluster.hosts)):
        (work / f"spool-n{i}").mkdir(exist_ok=True)
    conf = work / "slurm.conf"
    conf.write_text(slurm_conf(cluster, work, cpus))
    (work / "cgroup.conf").write_text(f"CgroupPlugin={_cgroup_plugin()}\nIgnoreSystemd=yes\n")
    env = {"SLURM_CONF": str(conf), "PATH": PATH}
    daemons: list[subprocess.Popen] = []

    def start(host_index: int, name: str, argv: str) -> None:
        # its own UTS namespace, named like its node; exec keeps the daemon the process we stop
        command = cluster.command(cluster.hosts[host_index],
                                  ["unshare", "--uts", "sh", "-c", f"hostname {name} && exec {argv}"])
        daemons.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    with _munged():
        try:
            start(0, "ctl", "slurmctld -D -i")
            for i in range(len(cluster.hosts)):
                start(i, f"n{i}", "slurmd -D")
            deadline = time.monotonic() + start_timeout_s
            states = ""
            while time.monotonic() < deadline:
                states = cluster.run(cluster.hosts[0], ["sinfo", "-h", "-N", "-o", "%T"], env=env,
                                     capture_output=True, text=True).stdout.split()
                if states == ["idle"] * len(cluster.hosts):
                    break
                time.sleep(0.5)
            else:
                log = (work / "slurmctld.log").read_text()[-2000:] if (work / "slurmctld.log").exists() else ""
                raise RuntimeError(f"Slurm nodes not idle within {start_timeout_s} s: {states}\n{log}")
            yield env
        finally:
            for daemon in daemons:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(daemon.pid, 9)
                daemon.wait()
