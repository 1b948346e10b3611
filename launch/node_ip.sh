#!/usr/bin/env bash
# Print the address this node should use for the cluster's traffic, and (with --ifname) its interface.
#   launch/node_ip.sh [--ifname] [TARGET]
# In order: NODE_IP if set; the IPv4 address of interface NODE_IFNAME if set; the source address the
# kernel routes to TARGET (the Ray head's address, for a node joining it); the source address of the
# default route (the head itself). Never "the first address `hostname -I` lists": that may be a
# docker bridge or a management NIC, and a host name may resolve to loopback (127.0.1.1 on many images).
set -euo pipefail

want_ifname=0
if [ "${1:-}" = "--ifname" ]; then want_ifname=1; shift; fi
target="${1:-}"

addr_of_ifname() { ip -o -4 addr show dev "$1" scope global | awk '{split($4, a, "/"); print a[1]; exit}'; }
ifname_of_addr() { ip -o -4 addr show scope global | awk -v ip="$1" '{split($4, a, "/"); if (a[1] == ip) {print $2; exit}}'; }
route_src() {  # the "src" field of `ip route get`
  ip -4 route get "$1" 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "src") {print $(i + 1); exit}}'
}

if [ -n "${NODE_IP:-}" ]; then
  ip_addr="$NODE_IP"
elif [ -n "${NODE_IFNAME:-}" ]; then
  ip_addr="$(addr_of_ifname "$NODE_IFNAME")"
  if [ -z "$ip_addr" ]; then echo "node_ip.sh: interface NODE_IFNAME=$NODE_IFNAME has no IPv4 address" >&2; exit 2; fi
elif [ -n "$target" ]; then
  target="${target%%:*}"
  if ! [[ "$target" =~ ^[0-9.]+$ ]]; then  # a host name: its IPv4 address
    target="$(getent ahostsv4 "$target" | awk '{print $1; exit}')"
  fi
  ip_addr="$(route_src "$target")"
else
  ip_addr="$(route_src 8.8.8.8)"  # the default route's source; nothing is sent
fi
if [ -z "${ip_addr:-}" ] || [[ "$ip_addr" == 127.* ]]; then
  echo "node_ip.sh: no routable address found${target:+ towards $target}; set NODE_IP or NODE_IFNAME" >&2
  exit 2
fi
if [ "$want_ifname" = 1 ]; then
  ifname="${NODE_IFNAME:-$(ifname_of_addr "$ip_addr")}"
  echo "$ip_addr ${ifname:-}"
else
  echo "$ip_addr"
fi
