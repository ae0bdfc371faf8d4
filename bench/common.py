"""What several bench scripts share, in one place.

* ``write_block``: a script's tables into its own block of RESULTS.md (``--write``; from
  ``results.py``).
* ``free_port``, ``rank_env``, ``wait_or_kill``: the environment torchrun would give local rank
  r, and one deadline for a launch (from ``tests/support/ranks.py``, which the tests use too).
* ``run_pair_in_namespaces``: a script's two ranks, each in its own network namespace joined by
  a veth link (``tests/support/netns.py``'s ``veth_pair``), optionally rate-limited.
* ``join_as_rank``: a rank's start (one thread, the process group, pinned to a core).
* ``median_seconds``: the median time of a few calls, on any clock.
* ``mlp_stack``, ``mse``: the uniform MLP several benchmarks run, and its loss.

torch is imported inside the functions that need it, so a driver that only launches ranks does
not pay for it.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
SRC = HERE.parent / "src"


# -- RESULTS.md, launching ranks: one harness each, shared -----------------------------------

# tests/support holds the one rank-launch and the one network-namespace harness (the tests use
# them too); appended, so nothing of tests/ shadows a module of bench/ or src/
if str(HERE.parent / "tests") not in sys.path:
    sys.path.append(str(HERE.parent / "tests"))

from results import write_block  # noqa: E402

from support.ranks import free_port, rank_env, wait_or_kill  # noqa: E402

__all__ = ["HERE", "RESULTS", "SRC", "write_block", "free_port", "rank_env", "wait_or_kill",
           "run_pair_in_namespaces", "join_as_rank", "median_seconds", "mlp_stack", "mse"]


def run_pair_in_namespaces(script: str, argv: Sequence[str], *, link: str | None,
                           port: int, cache: str, timeout: float) -> None:
    """Both ranks of ``script argv`` (gloo, one thread each), each in its own network namespace
    joined by a veth pair that ``link`` ('100mbit', '1gbit') limits each way, or None: unshaped.
    Rendezvous on rank 0's namespace address; gloo bound to the veth, so every byte between the
    ranks crosses the link. ``cache``: their ``$VARUNA_FX_CACHE_DIR`` (profiles)."""
    from support.netns import veth_pair

    with veth_pair(link) as pair:
        procs: list[subprocess.Popen] = []
        try:
            for rank in (0, 1):
                env = rank_env(rank, 2, port, addr=pair.addresses[0], local=False,
                               VARUNA_FX_CACHE_DIR=cache, PYTHONPATH=str(SRC),
                               GLOO_SOCKET_IFNAME=pair.interfaces[rank])
                procs.append(subprocess.Popen(pair.command(rank, [sys.executable, script,
                                                                  *argv]), env=env))
        except BaseException:
            for p in procs:  # only the processes started here
                p.kill()
            raise
        wait_or_kill(procs, timeout, f"on link {link or 'unshaped'}")


def join_as_rank(pin: bool) -> int:
    """A launched rank's start: one torch thread, the process group (5 minute timeout) and,
    with ``pin``, rank i alone on core i (as on two machines); returns the rank."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from varuna_fx.world.where import init_process_group

    init_process_group(timeout=300.0)
    rank = dist.get_rank()
    if pin:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    return rank


# -- timing ------------------------------------------------------------------------------------

def median_seconds(fn: Callable[[], Any], repeats: int,
                   clock: Callable[[], float] = time.perf_counter) -> float:
    """The median of ``repeats`` calls of ``fn`` on ``clock`` (``time.process_time``: CPU)."""
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


# -- models ------------------------------------------------------------------------------------

def mlp_stack(width: int = 1024, depth: int = 8) -> Any:
    """``depth`` Linear(width, width) + ReLU layers under ``layers.<i>`` (a uniform model:
    every cut sends the same bytes, so the balance is the partitioner's alone)."""
    import torch
    from torch import nn

    class MLPStack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x

    return MLPStack()


def mse(out: Any, target: Any) -> Any:
    import torch.nn.functional as F

    return F.mse_loss(out, target)
