"""Network-namespace "machines" joined by rate-limited links, for the benchmarks on commodity links.

``nodes(n, rate)`` makes ``n`` namespaces (the nodes) and one bridge namespace holding a Linux
bridge; node i's interface (address 10.78.0.{i+1}/24) is one end of a veth pair whose other end
is a port of the bridge. Each node's two directions are shaped separately with ``tc ... tbf``:
its egress on the node's end of the veth (what the node sends), its ingress as the egress of
the bridge's port (what the node receives), so a node is limited like a machine with one NIC
of that rate each way, and any pair of nodes talks at the slower of the two. Rates may differ
per node (``rate`` a list), and each direction may be given alone (``ingress=``).
``veth_pair(rate)`` is ``nodes(2, rate)``: the two-machine link of bench_network.py.

Rank i runs inside node i's namespace (``Nodes.command``), with gloo bound to the namespace's
interface (``GLOO_SOCKET_IFNAME=Nodes.interfaces[i]``), so every byte between ranks crosses
the shaped links; ``Nodes.counters(i)`` reads that interface's byte counters.

Every namespace name starts with a prefix (default ``netb``) plus this process's id (and a
``tag``), so parallel users do not collide; interfaces are created inside those namespaces (a
host interface is never made or touched). Everything is deleted on exit, also on an exception
or Ctrl-C. Needs root and iproute2 (``ip``, ``tc``); ``netem`` is not needed.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

SUBNET = "10.78.0"


@dataclass(frozen=True)
class Nodes:
    """The namespaces made by :func:`nodes`: one entry per node, in rank order."""

    namespaces: tuple[str, ...]
    interfaces: tuple[str, ...]     # inside each node's namespace
    addresses: tuple[str, ...]
    rates: tuple[str | None, ...]   # egress per node (None: unshaped)
    bridge: str                     # the bridge's namespace

    @property
    def rate(self) -> str | None:
        """The one rate of every node (the two-node pair's), None if unshaped or mixed."""
        return self.rates[0] if len(set(self.rates)) == 1 else None

    def command(self, rank: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside rank's namespace."""
        return ["ip", "netns", "exec", self.namespaces[rank], *argv]

    def counters(self, rank: int) -> tuple[int, int]:
        """(received, sent) bytes of node ``rank``'s interface so far (frames on the wire:
        Ethernet, IP and TCP headers included)."""
        out = subprocess.run(["ip", "netns", "exec", self.namespaces[rank], "cat",
                              "/proc/net/dev"], capture_output=True, text=True, check=True)
        return interface_bytes(out.stdout, self.interfaces[rank])


Pair = Nodes  # the two-node case (bench_network.py's name)


def interface_bytes(proc_net_dev: str, iface: str) -> tuple[int, int]:
    """(received, sent) bytes of ``iface`` in the text of a ``/proc/net/dev``."""
    for line in proc_net_dev.splitlines():
        name, sep, rest = line.partition(":")
        if sep and name.strip() == iface:
            fields = rest.split()
            return int(fields[0]), int(fields[8])
    raise KeyError(f"no interface {iface!r} in /proc/net/dev")


def _sh(*argv: str) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


def tbf_burst(rate_bits: float) -> int:
    """Bucket bytes: 4 ms at the rate (a 250 Hz kernel timer must be able to refill it), at
    least 32 KiB; small enough that a transfer of a few hundred KiB runs at the rate."""
    return max(32 * 1024, int(rate_bits / 8 * 0.004))


def rate_bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: write e.g. '100mbit' or '1gbit'")


def _shape(namespace: str, iface: str, rate: str | None) -> None:
    if rate is not None:
        _sh("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", iface, "root", "tbf",
            "rate", rate, "burst", str(tbf_burst(rate_bits(rate))), "latency", "100ms")


def _per_node(rate: str | None | Sequence[str | None], n: int) -> tuple[str | None, ...]:
    if rate is None or isinstance(rate, str):
        return (rate,) * n
    rates = tuple(rate)
    if len(rates) != n:
        raise ValueError(f"{len(rates)} rates for {n} nodes")
    return rates


@contextmanager
def nodes(n: int, rate: str | None | Sequence[str | None], tag: str = "",
          prefix: str = "netb",
          ingress: str | None | Sequence[str | None] = "same") -> Iterator[Nodes]:
    """``n`` node namespaces on one bridge; ``rate`` ('100mbit', '1gbit', None: unshaped, or one
    per node) limits what each node sends, ``ingress`` what it receives (default: the same).
    ``prefix`` starts the namespace names (with this process's id and ``tag`` after it) and the
    interface names."""
    if not 1 <= n <= 200:
        raise ValueError(f"{n} nodes: 1 to 200")
    egress = _per_node(rate, n)
    inbound = egress if isinstance(ingress, str) and ingress == "same" else _per_node(ingress, n)
    stem = f"{prefix}{os.getpid()}{tag}"
    names = tuple(f"{stem}n{i}" for i in range(n))
    bridge = f"{stem}br"
    # interface names live inside the namespaces (no clash with the host's); 15 characters
    ifaces = tuple(f"{prefix[:10]}{i}" for i in range(n))
    ports = [f"{prefix[:8]}p{i}" for i in range(n)]
    addrs = tuple(f"{SUBNET}.{i + 1}" for i in range(n))
    made: list[str] = []
    try:
        for ns in (bridge, *names):
            _sh("ip", "netns", "add", ns)
            made.append(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", bridge, "link", "set", "br0", "up")
        for i, (ns, iface, addr) in enumerate(zip(names, ifaces, addrs)):
            _sh("ip", "-n", bridge, "link", "add", ports[i], "type", "veth", "peer", "name",
                iface, "netns", ns)
            _sh("ip", "-n", bridge, "link", "set", ports[i], "master", "br0")
            _sh("ip", "-n", bridge, "link", "set", ports[i], "up")
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", iface)
            _sh("ip", "-n", ns, "link", "set", iface, "up")
            _shape(ns, iface, egress[i])            # what node i sends
            _shape(bridge, ports[i], inbound[i])    # what node i receives
        yield Nodes(names, ifaces, addrs, egress, bridge)
    finally:
        for ns in reversed(made):  # deleting a namespace deletes the veth ends inside it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@contextmanager
def veth_pair(rate: str | None, tag: str = "", prefix: str = "netb") -> Iterator[Nodes]:
    """Two nodes (``nodes(2, rate)``): rank 0 at 10.78.0.1, rank 1 at 10.78.0.2."""
    with nodes(2, rate, tag=tag, prefix=prefix) as pair:
        yield pair
