"""Closing a failed generation's connections at the socket level, so no survivor waits on it.

When a process vanishes mid-step, the survivors nearest to it fail at once (the kernel closes
its sockets) and the others are meant to fail in turn when those survivors destroy their process
groups: their gloo pairs close, and a peer blocked on them sees the connection closed. That only
holds if nothing in the survivor still references the old group. Gloo has no abort
(``ProcessGroupGloo.abort`` and ``shutdown`` leave the pairs open), and a work object kept
anywhere (a traceback, a queued bucket, a library's cache) keeps the group's sockets open. A peer
blocked on such a survivor then waits out its whole timeout (minutes), while the other survivors
wait for it in the membership store: measured on 4 machines, a kill stalled the job until the
timeout, or until the stuck process was counted lost with the dead one.

:func:`sever` therefore shuts down, with ``shutdown(2)``, every connected TCP socket the process
opened since its generation formed (:func:`opened` before forming), except connections to the
membership store. The peers see end-of-file at once, whatever still references the sockets.
Linux only (``/proc/self/fd``); elsewhere it does nothing and the group's destruction is all.
Base layer: the standard library only.
"""

from __future__ import annotations

import contextlib
import os
import socket

FD_DIR = "/proc/self/fd"


def _sockets() -> dict[str, int]:
    """This process's sockets: inode text (``socket:[N]``) -> a descriptor of it."""
    found: dict[str, int] = {}
    try:
        names = os.listdir(FD_DIR)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(os.path.join(FD_DIR, name))
        except OSError:  # closed meanwhile (the listing's own descriptor, for one)
            continue
        if target.startswith("socket:["):
            found.setdefault(target, int(name))
    return found


def opened() -> frozenset[str]:
    """The sockets open now (a generation's are those opened after this)."""
    return frozenset(_sockets())


def addresses(host: str) -> set[str]:
    """The IP addresses ``host`` names (as peers are reported: no IPv4-mapped prefix)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return {host}
    return {_plain(str(info[4][0])) for info in infos} | {host}


def _plain(ip: str) -> str:
    return ip.removeprefix("::ffff:")


def sever(before: frozenset[str], keep: set[tuple[str, int]]) -> int:
    """Shut down every connected TCP socket not in ``before`` whose peer (ip, port) is not in
    ``keep``; returns how many. The descriptors stay open (their owners close them); only the
    connections end, so the peers' reads and writes fail now."""
    count = 0
    for inode, fd in _sockets().items():
        if inode in before:
            continue
        try:
            copy = os.dup(fd)
        except OSError:  # closed meanwhile
            continue
        try:
            sock = socket.socket(fileno=copy)
        except OSError:  # not a socket Python can wrap
            os.close(copy)
            continue
        with contextlib.closing(sock):
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or \
                    sock.type != socket.SOCK_STREAM:
                continue
            try:
                host, port = sock.getpeername()[:2]
            except OSError:  # listening, or not connected
                continue
            if (_plain(host), port) in keep:
                continue
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
    return count
