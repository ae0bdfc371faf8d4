"""The network-namespace helper: nodes reach each other, shaped links give about their rate."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from support.netns import NetNS, netns_available, parse_rate

# Server: accept one connection, count bytes until EOF, print "bytes seconds" (first to last byte).
SERVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 16)
    if not b: break
    if t0 is None: t0 = time.perf_counter()
    n += len(b)
print(n, time.perf_counter() - t0, flush=True)
"""
CLIENT = r"""
import socket, sys, time
for _ in range(100):
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5); break
    except OSError: time.sleep(0.05)
s.sendall(b"x" * int(sys.argv[3])); s.close()
"""


def _transfer(net: NetNS, src: int, dst: int, nbytes: int) -> float:
    """Bytes per second received by node ``dst`` from node ``src`` over TCP."""
    server = net.popen(dst, [sys.executable, "-c", SERVER, net.addr(dst), "29500"],
                       stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    assert server.stdout.readline().strip() == "ready"
    net.run(src, [sys.executable, "-c", CLIENT, net.addr(dst), "29500", str(nbytes)],
            check=True, timeout=60)
    out, _ = server.communicate(timeout=60)
    n, secs = out.split()
    assert int(n) == nbytes
    return nbytes / float(secs)


def test_parse_rate() -> None:
    assert parse_rate("100mbit") == 1e8
    assert parse_rate("1Gbit") == 1e9
    assert parse_rate("1.5kbit") == 1500
    assert parse_rate("1mbps") == 8e6
    assert parse_rate(5e7) == 5e7
    with pytest.raises(ValueError):
        parse_rate("fast")
    with pytest.raises(ValueError):
        NetNS(3, topology="pair")


@pytest.mark.slow
def test_two_nodes_reach_each_other_and_tear_down() -> None:
    ok, why = netns_available(shaping=False)
    if not ok:
        pytest.skip(why)
    with NetNS(2) as net:
        names = [nd.ns for nd in net.nodes]
        rate = _transfer(net, 0, 1, 1 << 20)
        assert rate > 0
        # a node cannot see the host's interfaces, only lo and its veth end
        links = net.run(0, ["ip", "-o", "link"]).stdout
        assert "elas0" in links and links.count("\n") == 2, links
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)


@pytest.mark.slow
def test_teardown_on_exception_kills_processes() -> None:
    ok, why = netns_available(shaping=False)
    if not ok:
        pytest.skip(why)
    with pytest.raises(KeyboardInterrupt):
        with NetNS(3) as net:  # bridge topology
            names = [nd.ns for nd in net.nodes] + [net.hub]
            sleeper = net.popen(2, [sys.executable, "-c", "import time; time.sleep(60)"])
            assert _transfer(net, 2, 0, 1 << 18) > 0
            raise KeyboardInterrupt
    assert sleeper.poll() is not None
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["pair", "bridge"])
def test_shaped_link_gives_about_the_rate(topology: str) -> None:
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    rate_bits = 40e6
    with NetNS(2, rate=rate_bits, topology=topology) as net:
        t0 = time.perf_counter()
        got = _transfer(net, 0, 1, 5 * 1 << 20) * 8  # ~1 s at 40 Mbit/s
        assert time.perf_counter() - t0 < 20
        # TCP over tbf lands slightly under the rate (headers, ramp-up); never far above it
        assert 0.7 * rate_bits < got < 1.1 * rate_bits, f"{got / 1e6:.1f} Mbit/s"
        net.set_rate(None)
        assert _transfer(net, 0, 1, 5 * 1 << 20) * 8 > 3 * rate_bits


def test_per_node_rates_are_checked_before_anything_is_made() -> None:
    with pytest.raises(ValueError, match="3 rates for 2 nodes"):
        NetNS(2, rate=["1gbit", None, "1gbit"], topology="bridge")
    with pytest.raises(ValueError, match="only with topology='bridge'"):
        NetNS(2, rate="1gbit", ingress=None)  # a pair: ingress is the other end's egress
    net = NetNS(3, rate=["100mbit", None, 1e9], ingress="10mbit")
    assert net.egress_bps == (1e8, None, 1e9) and net.ingress_bps == (1e7,) * 3
    assert net.rate_bps is None  # mixed


@pytest.mark.slow
def test_a_node_sends_at_its_rate_receives_at_its_ingress_and_counts_bytes() -> None:
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    from support.netns import nodes

    rate_bits, nbytes = 40e6, 2 << 20
    with nodes(2, ["40mbit", None], ingress=[None, None]) as net:  # the benchmarks' bridge
        received_before = net.counters(1)[0]
        sent = _transfer(net, 0, 1, nbytes) * 8  # node 0's egress is shaped
        assert 0.6 * rate_bits < sent < 1.1 * rate_bits, f"{sent / 1e6:.1f} Mbit/s"
        assert net.counters(1)[0] - received_before >= nbytes  # frames: headers on top
        assert _transfer(net, 1, 0, nbytes) * 8 > 2 * rate_bits  # node 0's ingress is not
