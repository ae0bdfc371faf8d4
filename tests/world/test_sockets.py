"""Shutting down a failed generation's connections (``world/sockets.py``): only sockets opened
since the generation formed, never the store's, and a peer blocked on a survivor that still
holds its old group fails at once."""

from __future__ import annotations

import socket
import sys

import pytest

from varuna_fx.world import sockets

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/fd")


def _connected(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    return client, server


def test_only_new_connections_are_shut_and_the_store_is_kept() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            socket.create_server(("127.0.0.1", 0)) as store:
        old_client, old_server = _connected(listener)
        unix_a, unix_b = socket.socketpair()
        before = sockets.opened()
        new_client, new_server = _connected(listener)
        store_client, store_server = _connected(store)
        keep = {("127.0.0.1", store.getsockname()[1])}
        # new_client, new_server and store_server (its peer is the client's port) are shut;
        # store_client is kept; the listeners and the earlier sockets are not candidates
        assert sockets.sever(before, keep) == 3
        assert new_server.recv(1) == b"" and new_client.recv(1) == b""
        old_client.sendall(b"x")
        assert old_server.recv(1) == b"x"
        unix_a.sendall(b"y")
        assert unix_b.recv(1) == b"y"
        for s in (old_client, old_server, unix_a, unix_b, new_client, new_server, store_client,
                  store_server):
            s.close()


def test_addresses_are_plain_ips() -> None:
    assert "127.0.0.1" in sockets.addresses("localhost") | sockets.addresses("127.0.0.1")
    assert sockets._plain("::ffff:10.1.2.3") == "10.1.2.3"  # as getpeername reports IPv4


@pytest.mark.slow
def test_a_peer_blocked_on_a_survivor_that_keeps_its_group_fails_at_once() -> None:
    from support.dist import launch

    def waited(mode: str) -> float:
        ranks = launch("sever_probe.py", 3, [mode], timeout=90)
        line = next(x for x in ranks[2].output.splitlines() if x.startswith("RESULT"))
        assert line.startswith("RESULT failed"), ranks[2].output[-2000:]
        return float(line.split()[-1])

    # the premise: with the group destroyed but referenced, the peer waits until it exits
    assert waited("keep") > 4.0  # rank 1 waits 1 s, then holds its group 4 s
    assert waited("sever") < 2.5
