"""Where am I running: the one place that answers "launched as one rank of several?", the world
size and this process's rank, and that joins the process group torchrun described.

Everything else (planning, the runtimes, ``Cluster.local``, profiling) asks here, so the answer
cannot drift between them. Bottom layer: imports nothing from the package but ``errors``.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import PeerTimeoutError


def launched_distributed() -> bool:
    """True when this process is one rank of several (initialised, or torchrun's env)."""
    if not dist.is_available():
        return False
    if dist.is_initialized():
        return dist.get_world_size() > 1
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def in_process_group() -> bool:
    """A process group of more than one rank is formed (collectives can run now)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """Ranks in the job: the process group's, else torchrun's ``WORLD_SIZE``, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def running_world() -> int | None:
    """The world size of a distributed run (every rank needs a stage), None in one process."""
    return world_size() if launched_distributed() else None


def rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def local_world_size() -> int:
    """Ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``), at most the world."""
    world = world_size()
    return max(1, min(int(os.environ.get("LOCAL_WORLD_SIZE", str(world))), world))


def init_process_group(timeout: float) -> None:
    """Join the job torchrun described (env://) unless the user already did: gloo on CPU,
    NCCL on GPU. The rendezvous waits at most ``timeout`` for the other ranks."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    except (RuntimeError, dist.DistError) as exc:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise PeerTimeoutError(
            f"rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')} could "
            f"not form the process group at {where} within {timeout:.1f} s: some rank did not "
            f"start or crashed before vf.compile; see its log ({str(exc).splitlines()[0]})"
        ) from exc


def comm_device() -> torch.device:
    """Where collectives' tensors live: the current GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
