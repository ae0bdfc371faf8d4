"""``varuna-fx run`` on one machine: a rendezvous that only this machine can reach.

torchrun's ``--standalone`` names ``localhost:0`` as the rendezvous endpoint, but a
``TCPStore`` server listens on every interface whatever host it is given, so the launcher's
stores (the rendezvous and the workers' MASTER_PORT store) accept connections from the whole
network. For a run on one machine we pass the standalone settings explicitly with 127.0.0.1
and make every store server the launcher creates listen on a socket bound to 127.0.0.1
(``TCPStore(master_listen_fd=...)``). The workers' own gloo/NCCL sockets are put on the
loopback interface (``loopback_interfaces``).
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

LOOPBACK = "127.0.0.1"

_STORE_ARGS = ("host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers",
               "multi_tenant", "master_listen_fd", "use_libuv")


def standalone_args() -> list[str]:
    """torchrun flags equal to ``--standalone`` but on the loopback address."""
    return ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={LOOPBACK}:0",
            f"--rdzv-id={uuid.uuid4()}", f"--local-addr={LOOPBACK}"]


def loopback_interfaces(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for the workers of a one-machine run: gloo and NCCL open their pair
    sockets on the interface the hostname resolves to (a LAN address on most machines)
    unless told otherwise, so they are told the loopback interface. A value the user set
    is kept."""
    environ = os.environ if environ is None else environ
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    if not names:
        return {}
    return {key: names[0] for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
            if key not in environ}


def loopback_listener(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    sock.listen(4096)
    return sock


def store_arguments(args: tuple, kwargs: dict[str, Any]) -> tuple[dict[str, Any],
                                                                  socket.socket | None]:
    """TCPStore's arguments by name; a server without a listening socket gets a loopback one."""
    named = dict(zip(_STORE_ARGS, args), **kwargs)
    if not named.get("is_master") or named.get("master_listen_fd") is not None:
        return named, None
    sock = loopback_listener(int(named.get("port") or 0))
    named["master_listen_fd"] = sock.fileno()
    named["port"] = sock.getsockname()[1]
    return named, sock


@contextmanager
def loopback_stores() -> Iterator[None]:
    """Within: every TCPStore server torch.distributed's launcher creates binds 127.0.0.1."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    original = dist.TCPStore

    class LoopbackTCPStore(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            named, sock = store_arguments(args, kwargs)
            super().__init__(**named)
            self._listener = sock  # the store serves on this socket: keep it open

    patched = [(dist, "TCPStore"), (c10d_rendezvous_backend, "TCPStore")]
    for module, name in patched:
        setattr(module, name, LoopbackTCPStore)
    try:
        yield
    finally:
        for module, name in patched:
            setattr(module, name, original)
