"""Starting N local ranks the way torchrun would, shared by the tests and bench/.

``free_port`` picks a rendezvous port, ``rank_env`` is the environment torchrun gives rank r
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, one OpenMP thread),
and ``wait_or_kill`` waits for a set of launched processes with one deadline, killing only
those processes when it passes. ``support.dist.launch`` (the tests' jobs protocol) and
``bench/common.py`` (the benchmarks' drivers) are both built on these.

No torch here: a driver that only launches ranks does not pay for importing it. bench/ reaches
this module through ``sys.path`` (``bench/common.py`` puts ``tests/`` on it).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterable, Sequence


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, *, addr: str = "127.0.0.1", local: bool = True,
             drop: Iterable[str] = (), **extra: str) -> dict[str, str]:
    """This process's environment plus what torchrun gives rank ``rank`` of ``world``;
    ``local=False``: each rank on a machine of its own (LOCAL_RANK 0 of 1). ``drop``: variables
    the rank must not inherit; ``extra``: more variables, set last."""
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR=addr,
               MASTER_PORT=str(port), OMP_NUM_THREADS="1",
               LOCAL_RANK=str(rank if local else 0), LOCAL_WORLD_SIZE=str(world if local else 1))
    for name in drop:
        env.pop(name, None)
    env.update(extra)
    return env


def wait_or_kill(procs: Sequence[subprocess.Popen], timeout: float, what: str) -> None:
    """Wait for every process until ``timeout`` seconds from now; then kill what is left (only
    these processes) and raise SystemExit if any failed."""
    deadline = time.time() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed {what}")
