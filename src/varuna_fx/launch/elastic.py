"""``varuna-fx run --elastic``: torchrun's elastic agent set up so machines may leave and join.

One agent runs per machine (``--nproc`` workers each). Agents meet at a c10d rendezvous hosted
by the agent whose ``--local-addr`` is the rendezvous endpoint's host. When a machine vanishes
the survivors' workers fail on their next collective, their agents re-rendezvous without it and
restart the workers; when a machine (re)joins, the running agents see a node waiting, stop
their workers (SIGTERM: ``pipe.preempted`` saves a checkpoint) and restart them in the larger
world. Each restart runs the script from the top: ``vf.compile`` plans for the world it finds,
keeping ``global_batch_size`` (the micro-batch count adapts), and the script resumes from
``vf.latest_checkpoint`` -- the preemption-safe loop of docs/checkpoints.md.

Two settings make torchrun's defaults work for this (both found on torch 2.13, see
ARCHITECTURE.md "Elastic morphing"):

- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. With the default (the workers share the agent's TCP
  store), an agent caches the store address it got in its first rendezvous and only the agent
  that builds it publishes ``MASTER_ADDR`` under the round's key prefix. A machine joining a
  later round waits for ``torch.rendezvous.<id>.<round>/MASTER_ADDR``, which the surviving rank 0
  never writes again, while that rank 0 waits for the newcomer's ``torchelastic/role_info``:
  growing back times out after 60 s. With sharing off, rank 0 publishes a fresh address every
  round and the workers' store lives in worker rank 0.
- ``is_host`` in the rendezvous config: on machines that share a hostname (containers,
  namespaces) torchrun's guess of which agent hosts the c10d store is wrong; we set it from
  ``--local-addr``. That agent holds the rendezvous store: it must stay (a c10d limitation;
  etcd would remove it).

Heartbeats every second, 3 missed = gone, and a 1 s last call keep a morph short (torchrun's
defaults add up to 45 s).

The machine hosting ``--rdzv-endpoint`` must stay: when it vanishes the other agents stop within
a second with ``RendezvousConnectionError`` (the c10d backend has no failover; an etcd
rendezvous would). Found on torch 2.13 with two agents in network namespaces
(``tests/launch/test_elastic.py``, helper ``tests/support/netns.py``).

A shrunken job of one process runs the local runtime; under torchrun it still installs the
preemption handlers, so its agent's SIGTERM on a join saves instead of killing.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass, field

from ..errors import VarunaFxError

DEFAULT_PORT = 29400
RDZV_DEFAULTS = {"join_timeout": "600", "last_call_timeout": "1", "keep_alive_interval": "1",
                 "keep_alive_max_attempt": "3"}


@dataclass
class ElasticLaunch:
    """What to hand torchrun: its argv (before the script) and environment additions."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    is_host: bool | None = None


def parse_nnodes(spec: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", spec)
    if not m:
        raise VarunaFxError(f"--nnodes {spec!r}: write MIN:MAX (e.g. 1:4) or a number of machines")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) else lo
    if lo < 1 or hi < lo:
        raise VarunaFxError(f"--nnodes {spec!r}: need 1 <= MIN <= MAX")
    return lo, hi


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep:
        return endpoint, DEFAULT_PORT
    if not port.isdigit():
        raise VarunaFxError(f"--rdzv-endpoint {endpoint!r}: write HOST:PORT, e.g. 10.0.0.1:29400")
    return host.strip("[]"), int(port)


def _same_address(a: str, b: str) -> bool:
    try:
        return {ai[4][0] for ai in socket.getaddrinfo(a, None)} & \
               {bi[4][0] for bi in socket.getaddrinfo(b, None)} != set()
    except socket.gaierror:
        return a == b


def interface_of(addr: str) -> str | None:
    """The network interface (in this network namespace) that holds IPv4 ``addr``, if any."""
    try:
        ipaddress.IPv4Address(addr)
    except ValueError:
        return None
    if shutil.which("ip") is None:
        return None
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[3].split("/")[0] == addr:
            return parts[1].split("@")[0]
    return None


def elastic_launch(*, nproc: int, nnodes: str, rdzv_endpoint: str | None, rdzv_id: str,
                   local_addr: str | None, max_restarts: int, rdzv_conf: str | None = None,
                   is_host: bool | None = None) -> ElasticLaunch:
    """torchrun arguments for one machine of an elastic job (without the script)."""
    lo, hi = parse_nnodes(nnodes)
    if rdzv_endpoint is None:
        if hi > 1:
            raise VarunaFxError(
                "--elastic with more than one machine needs --rdzv-endpoint HOST:PORT: the "
                "address of the machine that hosts the rendezvous (it must stay up)")
        rdzv_endpoint = f"127.0.0.1:{DEFAULT_PORT}"
    host, port = _split_endpoint(rdzv_endpoint)
    conf = dict(RDZV_DEFAULTS)
    for item in filter(None, (rdzv_conf or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise VarunaFxError(f"--rdzv-conf {rdzv_conf!r}: write key=value[,key=value]")
        conf[key.strip()] = value.strip()
    if is_host is None and "is_host" not in conf and local_addr is not None:
        is_host = _same_address(host, local_addr)
    if is_host is not None:
        conf["is_host"] = "1" if is_host else "0"
    argv = [f"--nnodes={lo}:{hi}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={host}:{port}", f"--rdzv-id={rdzv_id}",
            f"--max-restarts={max_restarts}",
            "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items())]
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if local_addr is not None:
        argv.append(f"--local-addr={local_addr}")
        iface = interface_of(local_addr)
        # gloo picks its interface from the hostname, which on shared-hostname machines
        # resolves to the wrong one; the interface holding --local-addr is the right one
        if iface is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
            env["GLOO_SOCKET_IFNAME"] = iface
    host_flag = conf.get("is_host")
    return ElasticLaunch(argv=argv, env=env, is_host=None if host_flag is None
                         else host_flag.lower() in ("1", "true", "yes"))
