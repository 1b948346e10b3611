"""Hosts as Linux network namespaces (root only: `ip netns`, iproute2), for the launch scripts' address logic.

`multi_homed_host()` makes one namespace with two interfaces, the way a cluster node often looks: first a
docker-like bridge address (172.17.0.1, the first one `hostname -I` lists), then the cluster network
(10.9.0.2/24) that holds the default route. Commands run in it with `ip netns exec NAME ...`.
"""
from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Iterator

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
