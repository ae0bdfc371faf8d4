"""Network namespaces as "nodes" on one machine, joined by (optionally rate-limited) veth links.

The one network-namespace harness of the project: tests (elastic morphing: two torchrun agents
on two "nodes") and benchmarks (commodity links: 100 Mbit/s between ranks; bench/common.py puts
``tests/`` on ``sys.path``) both use it, as ``from support import netns``.

    ok, why = netns_available()
    with NetNS(2, rate="100mbit") as net:          # two namespaces, one veth pair, tbf each way
        server = net.popen(0, [sys.executable, "server.py", net.addr(0)])
        net.run(1, [sys.executable, "client.py", net.addr(0)], check=True)

Topology ``"pair"`` (default for 2 nodes) is one veth pair between the two namespaces;
``"bridge"`` (default for 3+) gives every node a veth to a Linux bridge that lives in its own
hub namespace, so nothing at all is added to the host's network namespace. Addresses come from
a private /24 (``10.77.0.0/24`` by default, node i gets ``.{i+1}``); since every address lives
only inside namespaces created here, traffic never leaves them, and two NetNS sets may use the
same subnet at once without seeing each other.

Every name starts with ``elas<pid>`` plus a counter, so parallel users never collide, and
everything is deleted on exit (normal, exception or KeyboardInterrupt) and, as a last resort,
at interpreter exit. Deleting a namespace deletes the veth ends inside it.

Rate limits use ``tc qdisc ... tbf`` (netem is not available on these machines) on the egress
of both ends of every link, so each direction is limited to ``rate``. ``shaper="htb"`` uses an
htb class instead. On a bridge each node's two directions are shaped apart: its egress on its
own end, its ingress on the hub's port, so a node is limited like a machine with one NIC of that
rate each way; ``rate`` may be one per node and ``ingress=`` may differ from it (the benchmarks'
uneven clusters). Only processes started with :meth:`NetNS.popen` are killed at teardown.

    with nodes(4, "100mbit") as net:             # the benchmarks' form: always a bridge
        argv = net.command(rank, [...])          # rank i inside node i
        env["GLOO_SOCKET_IFNAME"] = net.interfaces[rank]
        received, sent = net.counters(rank)      # that interface's bytes so far
"""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["NetNS", "Node", "netns_available", "parse_rate", "cleanup_stale", "nodes",
           "veth_pair", "interface_bytes"]

_counter = itertools.count()
_live: set[NetNS] = set()
_available: tuple[bool, str] | None = None
_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(rate: str | float | int) -> float:
    """Bits per second from a number (already bit/s) or ``"100mbit"`` / ``"1gbit"`` / ``"1.5Gbit"``.

    ``"bps"`` means bytes per second, as in tc.
    """
    if isinstance(rate, (int, float)):
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        return float(rate)
    m = _RATE_RE.match(rate)
    if not m:
        raise ValueError(f"cannot parse rate {rate!r}; write e.g. '100mbit', '1gbit' or 1e8 (bit/s)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if (m.group(3) or "bit").lower() == "bps":
        value *= 8
    if value <= 0:
        raise ValueError(f"rate must be positive, got {rate!r}")
    return value


Rate = str | float | None  # one link direction: "100mbit", bit/s, or None (unshaped)


def _per_node(rate: Rate | Sequence[Rate], n: int) -> tuple[float | None, ...]:
    if rate is None or isinstance(rate, (str, int, float)):
        rates: tuple[Rate, ...] = (rate,) * n
    else:
        rates = tuple(rate)
    if len(rates) != n:
        raise ValueError(f"{len(rates)} rates for {n} nodes")
    return tuple(None if r is None else parse_rate(r) for r in rates)


def interface_bytes(proc_net_dev: str, iface: str) -> tuple[int, int]:
    """(received, sent) bytes of ``iface`` in the text of a ``/proc/net/dev``."""
    for line in proc_net_dev.splitlines():
        name, sep, rest = line.partition(":")
        if sep and name.strip() == iface:
            fields = rest.split()
            return int(fields[0]), int(fields[8])
    raise KeyError(f"no interface {iface!r} in /proc/net/dev")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _sh(cmd: Sequence[str]) -> None:
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")


def netns_available(*, shaping: bool = True) -> tuple[bool, str]:
    """Whether namespaces (and, with ``shaping``, tbf) can be created here; reason if not.

    Tries the real thing once (a namespace, a veth inside it, a tbf qdisc) and caches the answer,
    so a test can ``pytest.skip(reason)`` with the actual error instead of failing in setup.
    """
    global _available
    if _available is not None and (_available[0] or not shaping):
        return _available
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "creating network namespaces needs root (euid is not 0)"
    for tool in ("ip", "tc") if shaping else ("ip",):
        if shutil.which(tool) is None:
            return False, f"the `{tool}` command (iproute2) is not installed"
    name = f"elas{os.getpid()}p{next(_counter)}"
    try:
        _sh(["ip", "netns", "add", name])
        try:
            _sh(["ip", "-n", name, "link", "add", "elasa", "type", "veth", "peer", "name", "elasb"])
            if shaping:
                _sh(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "elasa", "root",
                     "tbf", "rate", "10mbit", "burst", "32kb", "latency", "50ms"])
        finally:
            _ip("netns", "del", name, check=False)
    except (RuntimeError, OSError) as e:
        _available = (False, f"cannot create a network namespace with a veth"
                      f"{' and tbf' if shaping else ''} here: {e}")
        return _available
    _available = (True, "")
    return _available


@dataclass(frozen=True)
class Node:
    index: int
    ns: str  # namespace name
    iface: str  # its interface towards the link / bridge
    addr: str  # IPv4 address on the private /24


class NetNS:
    """Create ``n`` namespaces ("nodes") joined by veth links; tear everything down on exit.

    n: number of nodes (>= 1).
    rate: per-direction limit of every link (``"100mbit"``, bit/s as a number) or None; or one
        per node (what each node sends).
    ingress: on a bridge, what each node receives (one rate or one per node); default ``rate``.
    topology: ``"pair"`` (2 nodes, one veth pair) or ``"bridge"``; default pair for 2 nodes.
    subnet: private IPv4 /24 (or larger) for the nodes; node i gets host address i + 1.
    shaper: ``"tbf"`` or ``"htb"``.
    burst: tbf bucket in bytes; default max(32 KiB, 4 ms at ``rate``) so a 250 Hz timer keeps up.
    """

    def __init__(self, n: int, *, rate: Rate | Sequence[Rate] = None,
                 topology: str | None = None, subnet: str = "10.77.0.0/24", shaper: str = "tbf",
                 burst: int | None = None, mtu: int | None = None,
                 ingress: Rate | Sequence[Rate] | str = "same") -> None:
        if n < 1:
            raise ValueError("NetNS needs at least one node")
        self.topology = topology or ("pair" if n == 2 else "bridge")
        if self.topology not in ("pair", "bridge"):
            raise ValueError(f"topology must be 'pair' or 'bridge', got {self.topology!r}")
        if self.topology == "pair" and n != 2:
            raise ValueError("topology='pair' joins exactly 2 nodes; use 'bridge' for more")
        if shaper not in ("tbf", "htb"):
            raise ValueError(f"shaper must be 'tbf' or 'htb', got {shaper!r}")
        self.n = n
        self.egress_bps = _per_node(rate, n)
        same = isinstance(ingress, str) and ingress == "same"
        self.ingress_bps = self.egress_bps if same else _per_node(ingress, n)  # type: ignore[arg-type]
        if self.topology == "pair" and not same:
            raise ValueError("a veth pair's ingress is the other end's egress: give ingress= "
                             "only with topology='bridge'")
        uniform = set(self.egress_bps) | set(self.ingress_bps)
        self.rate_bps = uniform.pop() if len(uniform) == 1 else None  # None: unshaped or mixed
        self.shaper = shaper
        self.burst = burst
        self.mtu = mtu
        self.net = ipaddress.ip_network(subnet)
        if self.net.num_addresses < n + 2:
            raise ValueError(f"subnet {subnet} too small for {n} nodes")
        self.prefix = f"elas{os.getpid()}n{next(_counter)}"
        self.nodes: list[Node] = []
        self.hub: str | None = None
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._up = False

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> NetNS:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> NetNS:
        shaped = any(r is not None for r in (*self.egress_bps, *self.ingress_bps))
        ok, why = netns_available(shaping=shaped)
        if not ok:
            raise RuntimeError(why)
        _live.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self._up = True
        return self

    def close(self) -> None:
        """Kill processes started with :meth:`popen`, delete every namespace. Idempotent."""
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # popen starts a new session: whole group
                except (ProcessLookupError, PermissionError):
                    pass
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        self._procs.clear()
        for i in range(len(self.nodes)):  # anything else still running inside a node
            self.kill(i, signal.SIGKILL)
        for ns in reversed(self._namespaces):
            _ip("netns", "del", ns, check=False)
        self._namespaces.clear()
        self._up = False
        _live.discard(self)

    # -- construction ------------------------------------------------------------------------
    def _add_ns(self, name: str) -> str:
        _sh(["ip", "netns", "add", name])
        self._namespaces.append(name)
        _sh(["ip", "-n", name, "link", "set", "lo", "up"])
        return name

    def _build(self) -> None:
        hosts = list(self.net.hosts())
        plen = self.net.prefixlen
        names = [self._add_ns(f"{self.prefix}_{i}") for i in range(self.n)]
        # Interface names live inside the namespaces (created there directly with `ip -n`), so
        # short fixed names cannot collide with anything in the host or in another NetNS.
        if self.topology == "pair":
            _sh(["ip", "-n", names[0], "link", "add", "elas0", "type", "veth",
                 "peer", "name", "elas1", "netns", names[1]])
            ends = [(names[0], "elas0"), (names[1], "elas1")]
            shaped = [(*ends[0], self.egress_bps[0]), (*ends[1], self.egress_bps[1])]
        else:
            self.hub = self._add_ns(f"{self.prefix}_hub")
            _sh(["ip", "-n", self.hub, "link", "add", "elasbr", "type", "bridge"])
            _sh(["ip", "-n", self.hub, "link", "set", "elasbr", "up"])
            ends, shaped = [], []
            for i, ns in enumerate(names):
                port = f"elasp{i}"
                _sh(["ip", "-n", self.hub, "link", "add", port, "type", "veth",
                     "peer", "name", "elas0", "netns", ns])
                _sh(["ip", "-n", self.hub, "link", "set", port, "master", "elasbr"])
                _sh(["ip", "-n", self.hub, "link", "set", port, "up"])
                ends.append((ns, "elas0"))
                # both directions of node i's link: its own egress and the hub port's egress
                shaped += [(ns, "elas0", self.egress_bps[i]), (self.hub, port, self.ingress_bps[i])]
        for i, (ns, iface) in enumerate(ends):
            if self.mtu:
                _sh(["ip", "-n", ns, "link", "set", iface, "mtu", str(self.mtu)])
            _sh(["ip", "-n", ns, "addr", "add", f"{hosts[i]}/{plen}", "dev", iface])
            _sh(["ip", "-n", ns, "link", "set", iface, "up"])
            self.nodes.append(Node(i, ns, iface, str(hosts[i])))
        for ns, iface, rate_bps in shaped:
            if rate_bps is not None:
                self._shape(ns, iface, rate_bps)

    def _shape(self, ns: str, iface: str, rate_bps: float) -> None:
        rate = f"{int(rate_bps)}bit"
        tc = ["ip", "netns", "exec", ns, "tc"]
        subprocess.run([*tc, "qdisc", "del", "dev", iface, "root"], capture_output=True)
        if self.shaper == "tbf":
            burst = self.burst or max(32 * 1024, int(rate_bps / 8 * 0.004))
            _sh([*tc, "qdisc", "add", "dev", iface, "root", "tbf", "rate", rate,
                 "burst", str(burst), "latency", "100ms"])
        else:
            _sh([*tc, "qdisc", "add", "dev", iface, "root", "handle", "1:", "htb", "default", "1"])
            _sh([*tc, "class", "add", "dev", iface, "parent", "1:", "classid", "1:1", "htb",
                 "rate", rate, "ceil", rate])

    def set_rate(self, rate: str | float | None) -> None:
        """Change (or with None remove) the limit on every link of a running NetNS."""
        self.rate_bps = parse_rate(rate) if rate is not None else None
        self.egress_bps = self.ingress_bps = (self.rate_bps,) * self.n
        ends = [(nd.ns, nd.iface) for nd in self.nodes]
        if self.hub is not None:
            ends += [(self.hub, f"elasp{i}") for i in range(self.n)]
        for ns, iface in ends:
            if self.rate_bps is None:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", iface,
                                "root"], capture_output=True)
            else:
                self._shape(ns, iface, self.rate_bps)

    def link(self, i: int, up: bool) -> None:
        """Take node i's interface down or up (a node dropping off the network)."""
        nd = self.nodes[i]
        _sh(["ip", "-n", nd.ns, "link", "set", nd.iface, "up" if up else "down"])

    def pids(self, i: int) -> list[int]:
        """Every process running inside node i's namespace (``ip netns pids``)."""
        out = _ip("netns", "pids", self.nodes[i].ns, check=False).stdout
        return [int(t) for t in out.split()]

    def kill(self, i: int, sig: int = signal.SIGKILL, *, timeout: float = 10.0) -> None:
        """Send ``sig`` to every process in node i (a machine vanishing: the launcher and the
        workers it started in their own sessions alike); with SIGKILL wait until all are gone."""
        for pid in self.pids(i):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig != signal.SIGKILL:
            return
        deadline = time.monotonic() + timeout
        while self.pids(i) and time.monotonic() < deadline:
            time.sleep(0.02)
        for p in self._procs:  # reap our own children so they do not linger as zombies
            if p.args[3:4] and p.args[3] == self.nodes[i].ns:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass

    # -- running things ----------------------------------------------------------------------
    def addr(self, i: int) -> str:
        return self.nodes[i].addr

    def ns(self, i: int) -> str:
        return self.nodes[i].ns

    def cmd(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside node i's namespace."""
        return ["ip", "netns", "exec", self.nodes[i].ns, *argv]

    command = cmd  # the benchmarks' name

    @property
    def namespaces(self) -> tuple[str, ...]:
        return tuple(nd.ns for nd in self.nodes)

    @property
    def interfaces(self) -> tuple[str, ...]:
        """Each node's interface, in its own namespace (what ``GLOO_SOCKET_IFNAME`` names)."""
        return tuple(nd.iface for nd in self.nodes)

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(nd.addr for nd in self.nodes)

    def counters(self, i: int) -> tuple[int, int]:
        """(received, sent) bytes of node i's interface so far (frames on the wire: Ethernet,
        IP and TCP headers included)."""
        out = self.run(i, ["cat", "/proc/net/dev"], check=True)
        return interface_bytes(out.stdout, self.nodes[i].iface)

    def run(self, i: int, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        """subprocess.run inside node i (text output captured unless told otherwise)."""
        kw.setdefault("capture_output", "stdout" not in kw and "stderr" not in kw)
        kw.setdefault("text", True)
        return subprocess.run(self.cmd(i, argv), **kw)

    def popen(self, i: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """subprocess.Popen inside node i, in a new session; killed (whole group) at teardown."""
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.cmd(i, argv), **kw)
        self._procs.append(p)
        return p

    def __repr__(self) -> str:
        rate = f", rate={self.rate_bps:.3g}bit/s" if self.rate_bps else ""
        return f"NetNS({self.n}, {self.topology}{rate}, {[nd.addr for nd in self.nodes]})"


@contextmanager
def nodes(n: int, rate: Rate | Sequence[Rate],
          ingress: Rate | Sequence[Rate] | str = "same") -> Iterator[NetNS]:
    """``n`` nodes on one bridge (also for two: the benchmarks measure through a bridge), node
    i sending at ``rate`` (or ``rate[i]``) and receiving at ``ingress`` (default the same)."""
    with NetNS(n, rate=rate, topology="bridge", ingress=ingress) as net:
        yield net


def veth_pair(rate: Rate) -> AbstractContextManager[NetNS]:
    """Two nodes (``nodes(2, rate)``): a two-machine link, rank 0 at ``addresses[0]``."""
    return nodes(2, rate)


def cleanup_stale() -> list[str]:
    """Delete namespaces named ``elas<pid>...`` whose creating process no longer exists."""
    out = _ip("netns", "list", check=False).stdout
    removed = []
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.match(r"^elas(\d+)[np]\d+", name)
        if not m:
            continue
        if not os.path.exists(f"/proc/{m.group(1)}"):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


@atexit.register
def _close_all() -> None:  # last resort if a NetNS was never closed (e.g. os._exit elsewhere)
    for net in list(_live):
        net.close()
