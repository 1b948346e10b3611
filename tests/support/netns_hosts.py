"""Hosts as Linux network namespaces (root only: `ip netns`, iproute2): the launch scripts' address logic, and
runs across machines (`Cluster`).

`multi_homed_host()` makes one namespace with two interfaces, the way a cluster node often looks: first a
docker-like bridge address (172.17.0.1, the first one `hostname -I` lists), then the cluster network
(10.9.0.2/24) that holds the default route. Commands run in it with `ip netns exec NAME ...`.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator

BRIDGE_IP, CLUSTER_IP, CLUSTER_GATEWAY = "172.17.0.1", "10.9.0.2", "10.9.0.1"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def multi_homed_host() -> Iterator[str]:
    """A namespace with a bridge-like interface `br0` and a cluster interface `eth9`; yields its name."""
    name = f"hybridrl-{uuid.uuid4().hex[:8]}"
    _ip("netns", "add", name)
    try:
        # veth pairs kept inside the namespace: each end up, one end addressed
        _ip("-n", name, "link", "add", "br0", "type", "veth", "peer", "name", "br0p")
        _ip("-n", name, "link", "add", "eth9", "type", "veth", "peer", "name", "eth9p")
        _ip("-n", name, "addr", "add", f"{BRIDGE_IP}/16", "dev", "br0")
        _ip("-n", name, "addr", "add", f"{CLUSTER_IP}/24", "dev", "eth9")
        for dev in ("lo", "br0", "br0p", "eth9", "eth9p"):
            _ip("-n", name, "link", "set", dev, "up")
        _ip("-n", name, "route", "add", "default", "via", CLUSTER_GATEWAY)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


# ---- several hosts on one private network, for runs across machines ------------------------------------

DOCKER_LIKE_IP = "172.17.0.1"  # on every cluster host, listed first by `hostname -I`, routing nowhere


@dataclasses.dataclass(frozen=True)
class Host:
    namespace: str
    address: str  # its IPv4 address on the cluster network
    ifname: str  # the interface holding it (one end of a veth pair; the other end is on the switch)


class Cluster:
    """`count` hosts (network namespaces) on one /24, joined by a Linux bridge in a switch namespace of its own.

    Each host has its own loopback, its cluster interface (`Host.ifname`, with a default route through the
    cluster network, as on a real node) and, listed first, a docker-like bridge address that reaches nothing
    (so an address picked from `hostname -I` or the host name is wrong, as it often is on real nodes). The
    filesystem is shared. Leaving the context kills every process still in a host and deletes the namespaces,
    also when the test failed. Root only.
    """

    def __init__(self, count: int) -> None:
        token = uuid.uuid4().hex[:6]
        net = int(token[:4], 16)
        self.subnet = f"10.{200 + net % 50}.{net // 50 % 250}"
        self.switch = f"hrl{token}sw"
        self.hosts = [Host(f"hrl{token}h{i}", f"{self.subnet}.{i + 1}", f"hrl{token}e{i}") for i in range(count)]

    def __enter__(self) -> Cluster:
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for host in self.hosts:
                _ip("netns", "add", host.namespace)
                # the docker-like interface first: `hostname -I` lists it before the cluster address
                _ip("-n", host.namespace, "link", "add", "docker0", "type", "veth", "peer", "name", "docker0p")
                _ip("-n", host.namespace, "addr", "add", f"{DOCKER_LIKE_IP}/16", "dev", "docker0")
                port = f"{host.ifname}s"
                _ip("link", "add", host.ifname, "netns", host.namespace, "type", "veth", "peer", "name", port,
                    "netns", self.switch)
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
                _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.ifname)
                for dev in ("lo", "docker0", "docker0p", host.ifname):
                    _ip("-n", host.namespace, "link", "set", dev, "up")
                _ip("-n", host.namespace, "route", "add", "default", "via", f"{self.subnet}.254")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for name in [h.namespace for h in self.hosts] + [self.switch]:
            self.kill_processes(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def command(self, host: Host, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", host.namespace, *argv]

    def popen(self, host: Host, argv: list[str], **kwargs: object) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), **kwargs)  # type: ignore[call-overload]

    def run(self, host: Host, argv: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), **kwargs)  # type: ignore[call-overload]

    def pids(self, namespace: str) -> list[int]:
        result = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
        return [int(p) for p in result.stdout.split()]

    def kill_processes(self, namespace: str) -> None:
        for _ in range(50):
            pids = self.pids(namespace)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)

    def sent_bytes(self, host: Host) -> int:
        """Bytes the host has sent on its cluster link (the veth's counter)."""
        out = self.run(host, ["cat", f"/sys/class/net/{host.ifname}/statistics/tx_bytes"], capture_output=True,
                       text=True, check=True)
        return int(out.stdout)

    @contextlib.contextmanager
    def link_samples(self, interval_s: float = 0.005) -> Iterator[LinkSamples]:
        """While open, every `interval_s` the bytes each host has sent so far (read on the switch: what its
        port received), with the Unix time of the reading, from one sampler process in the switch namespace."""
        ports = " ".join(f"/sys/class/net/{h.ifname}s/statistics/rx_bytes" for h in self.hosts)
        # each counter's file kept open and read again at offset 0 (sysfs makes it anew; ~2 us against ~50 us for an
        # open and a read): at 200 readings a second the sampler took ~10 CPU-s of a two-minute run opening them
        loop = ("import os, sys, time\nfds = [os.open(p, os.O_RDONLY) for p in sys.argv[2].split()]\n"
                "interval = float(sys.argv[1])\n"
                "while True:\n    values = [os.pread(fd, 32, 0).strip() for fd in fds]\n"
                "    os.write(1, b' '.join([repr(time.time()).encode(), *values]) + b'\\n')\n"
                "    time.sleep(interval)")
        sampler = subprocess.Popen(["ip", "netns", "exec", self.switch, sys.executable, "-I", "-S", "-c", loop,
                                    str(interval_s), ports], stdout=subprocess.PIPE, text=True)
        samples = LinkSamples(len(self.hosts))
        reader = threading.Thread(target=samples.read, args=(sampler.stdout,), daemon=True)
        reader.start()
        try:
            yield samples
        finally:
            sampler.kill()
            sampler.wait()
            reader.join(timeout=5)

    def set_link(self, host: Host, up: bool) -> None:
        _ip("-n", host.namespace, "link", "set", host.ifname, "up" if up else "down")


class LinkSamples:
    """(Unix time, bytes sent so far by each host) readings; `sent(host_index, start, end)` the bytes a host sent
    in a window, each end read as the last reading at or before it (traffic bursts at a phase's start: a line
    drawn between the readings around the boundary would give part of the burst to the phase before)."""

    def __init__(self, hosts: int) -> None:
        self.hosts = hosts
        self.times: list[float] = []
        self.values: list[list[int]] = []

    def read(self, stream: Iterable[str]) -> None:
        for line in stream:
            fields = line.split()
            if len(fields) == self.hosts + 1:
                self.times.append(float(fields[0]))
                self.values.append([int(v) for v in fields[1:]])

    def at(self, host: int, when: float) -> int:
        index = bisect.bisect_right(self.times, when)
        if index == 0 or index == len(self.times):
            raise ValueError(f"{when:.3f} is outside the readings ({self.times[0]:.3f} .. {self.times[-1]:.3f})")
        return self.values[index - 1][host]

    def sent(self, host: int, start: float, end: float) -> int:
        return self.at(host, end) - self.at(host, start)
