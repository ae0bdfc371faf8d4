"""Two network namespaces joined by a veth pair, optionally rate-limited with tbf each way.

The benchmark's "two machines on a commodity link": rank i runs inside namespace i, ranks
talk over the veth pair (10.78.0.1 <-> 10.78.0.2), and ``tc ... tbf`` limits each direction.
Every name starts with a prefix (default ``netb``; ``bench_network.py --prefix``) plus this
process's id, so parallel users do not collide, and everything is deleted on exit, also on an
exception or Ctrl-C. Needs root and iproute2 (``ip``, ``tc``); ``netem`` is not needed.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

SUBNET = "10.78.0"


@dataclass(frozen=True)
class Pair:
    namespaces: tuple[str, str]
    interfaces: tuple[str, str]
    addresses: tuple[str, str]
    rate: str | None

    def command(self, rank: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside rank's namespace."""
        return ["ip", "netns", "exec", self.namespaces[rank], *argv]


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


@contextmanager
def veth_pair(rate: str | None, tag: str = "", prefix: str = "netb") -> Iterator[Pair]:
    """Create the namespaces and link; ``rate`` ('100mbit', '1gbit') or None: unshaped.
    ``prefix`` starts the namespace names (with this process's id after it)."""
    stem = f"{prefix}{os.getpid()}{tag}"
    names = (f"{stem}a", f"{stem}b")
    ifaces = ("netb0", "netb1")  # inside the namespaces: cannot clash with the host's
    addrs = (f"{SUBNET}.1", f"{SUBNET}.2")
    made: list[str] = []
    try:
        for ns in names:
            _sh("ip", "netns", "add", ns)
            made.append(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", names[0], "link", "add", ifaces[0], "type", "veth", "peer", "name",
            ifaces[1], "netns", names[1])
        for ns, iface, addr in zip(names, ifaces, addrs):
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", iface)
            _sh("ip", "-n", ns, "link", "set", iface, "up")
            if rate is not None:
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", iface, "root", "tbf",
                    "rate", rate, "burst", str(tbf_burst(rate_bits(rate))), "latency", "100ms")
        yield Pair(names, ifaces, addrs, rate)
    finally:
        for ns in reversed(made):  # deleting a namespace deletes the veth end inside it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
