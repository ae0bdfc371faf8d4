"""Where am I running: the one place that answers "launched as one rank of several?", the world
size and this process's rank, and that joins the process group torchrun described.

Everything else (planning, the runtimes, ``Cluster.local``, profiling) asks here, so the answer
cannot drift between them. Bottom layer: imports nothing from the package but ``errors``.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DistributedError, PeerTimeoutError, VarunaFxError, env_int

DEFAULT_TIMEOUT = 300.0  # seconds; generous: a slow first step (allocator, lazy init) is fine
TIMEOUT_ENV = "VARUNA_FX_TIMEOUT"


def check_seconds(name: str, value: object) -> float:
    """A positive, finite number of seconds (NaN would make every deadline pass or none)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise VarunaFxError(f"{name}={value!r}: give a number of seconds, e.g. 60")
    if not math.isfinite(value) or value <= 0:
        raise VarunaFxError(f"{name}={value!r}: give a positive, finite number of seconds "
                            "(e.g. 60); to wait long, give a large number")
    return float(value)


def resolve_timeout(timeout: float | None) -> float:
    """The ``timeout=`` keyword, else ``$VARUNA_FX_TIMEOUT``, else 300 s: every wait on a peer,
    the rendezvous included."""
    if timeout is None and os.environ.get(TIMEOUT_ENV):
        text = os.environ[TIMEOUT_ENV]
        try:
            value = float(text)
        except ValueError:
            raise VarunaFxError(
                f"{TIMEOUT_ENV}={text!r} is not a number of seconds; set it to e.g. 60"
            ) from None
        return check_seconds(TIMEOUT_ENV, value)
    if timeout is None:
        return DEFAULT_TIMEOUT
    return check_seconds("timeout", timeout)


def launched_distributed() -> bool:
    """True when this process is one rank of several (initialised, or torchrun's env)."""
    if not dist.is_available():
        return False
    if dist.is_initialized():
        return dist.get_world_size() > 1
    return env_int("WORLD_SIZE", 1, minimum=1) > 1


def in_process_group() -> bool:
    """A process group of more than one rank is formed (collectives can run now)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """Ranks in the job: the process group's, else torchrun's ``WORLD_SIZE``, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return env_int("WORLD_SIZE", 1, minimum=1)


def running_world() -> int | None:
    """The world size of a distributed run (every rank needs a stage), None in one process."""
    return world_size() if launched_distributed() else None


def rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return env_int("RANK", 0)


def local_world_size() -> int:
    """Ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``), at most the world."""
    world = world_size()
    return max(1, min(env_int("LOCAL_WORLD_SIZE", world, minimum=1), world))


def init_process_group(timeout: float) -> None:
    """Join the job torchrun described (env://) unless the user already did: gloo on CPU,
    NCCL on GPU. The rendezvous waits at most ``timeout`` for the other ranks."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = env_int("LOCAL_RANK", 0)

    def join() -> None:
        if backend == "nccl":  # the current device is per thread: set it where NCCL starts too
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))

    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    try:
        _with_deadline(join, timeout)
    except TimeoutError:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise PeerTimeoutError(
            f"rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')} could "
            f"not join the rendezvous at {where} within {timeout:.1f} s: nothing there answered "
            "as torch.distributed's store. Another program may hold that port (choose a free "
            "one: --master-port / MASTER_PORT), or rank 0 did not start"
        ) from None
    except (RuntimeError, dist.DistError) as exc:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
            raise DistributedError(
                f"rank {os.environ.get('RANK', '?')} could not listen on {where}: another "
                "program holds that port; choose a free one (--master-port / MASTER_PORT)"
            ) from exc
        raise PeerTimeoutError(
            f"rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')} could "
            f"not form the process group at {where} within {timeout:.1f} s: some rank did not "
            f"start or crashed before vf.compile; see its log ({str(exc).splitlines()[0]})"
        ) from exc


def _with_deadline(join: Callable[[], None], timeout: float) -> None:
    """Run ``join`` but give up after ``timeout`` (+ a little): the store client's own timeout
    does not cover a peer that accepts the connection and never answers (another program on
    the master port), where it would block for minutes. The call runs in a daemon thread that
    is abandoned on timeout; the process is expected to exit on the error."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            join()
            outcome.append(None)
        except BaseException as exc:  # handed to the caller's thread below
            outcome.append(exc)

    thread = threading.Thread(target=run, name="varuna_fx-rendezvous", daemon=True)
    thread.start()
    thread.join(timeout + 1.0)
    if not outcome:
        raise TimeoutError
    if outcome[0] is not None:
        raise outcome[0]


def comm_device() -> torch.device:
    """Where collectives' tensors live: the current GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# -- the links between the ranks ------------------------------------------------------------

@dataclass(frozen=True)
class NetworkProfile:
    """Measured transfer costs: ``latency + bytes / bandwidth`` per message, and an all-reduce
    fitted as ``allreduce_latency + 2 (D-1)/D * bytes / allreduce_bandwidth``."""

    latency: float
    bandwidth: float
    allreduce_latency: float
    allreduce_bandwidth: float
    world_size: int = 2


def quick_network(target: float = 0.03, largest: int = 2**24,
                  smallest: int = 2**10) -> NetworkProfile | None:
    """The links this job will use, measured in about a second: neighbouring ranks ping-pong
    (pairs (0, 1), (2, 3), ... then (1, 2), (3, 4), ...: every link r -> r + 1 a pipeline
    uses), first a tiny message (the latency), then messages growing 64x then 4x until one
    way takes ``target`` seconds (a slow link is timed with about a MiB, a fast one with up to
    ``largest`` bytes); then an all-reduce of the small and a large size. One direction at a
    time, as a pipeline mostly sends: on a shaped link, traffic both ways at once also queues
    each direction's acknowledgements behind the other's data (measured: 55-80 instead of 99
    Mbit/s on a 100 Mbit/s tbf link). Each timing is the slowest rank's median, agreed with an
    all-reduce of the maxima, so every rank derives the same numbers (the slowest link
    decides). Every rank must call it; None without a process group of 2+."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) \
        if torch.cuda.is_available() and dist.get_backend() == "nccl" else torch.device("cpu")

    def agreed(seconds: float) -> float:
        slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return float(slowest.item())

    def one_way(nbytes: int, repeats: int) -> float:
        offsets = (0, 1) if world > 2 else (0,)
        return agreed(max(_pair_ping_pong(nbytes, rank, world, k, device, repeats)
                          for k in offsets))

    small = one_way(smallest, 5)
    size, big = smallest, small
    while size < largest and big < target:
        size = min(largest, size * 64 if size == smallest else size * 4)
        big = one_way(size, 2)
    latency, bandwidth = _two_point(smallest, small, size, big)
    factor = 2 * (world - 1) / world
    reduce_size = max(smallest * 4, size // 4)
    ar_small = agreed(timed_allreduce([torch.zeros(smallest // 4, device=device)], world, 3))
    ar_big = agreed(timed_allreduce([torch.zeros(reduce_size // 4, device=device)], world, 2))
    ar_latency, ar_bandwidth = _two_point(factor * smallest, ar_small,
                                          factor * reduce_size, ar_big)
    return NetworkProfile(latency, bandwidth, ar_latency, ar_bandwidth, world)


def _pair_ping_pong(nbytes: int, rank: int, world: int, offset: int, device: object,
                    repeats: int) -> float:
    """Half the median round trip of ``nbytes`` between this rank and its partner: ranks
    ``offset + 2k`` and ``offset + 2k + 1`` (mod world) pair up; with an odd world one rank
    sits out (0.0)."""
    import torch
    import torch.distributed as dist

    position = (rank - offset) % world
    alone = world % 2 == 1 and position == world - 1
    leader = position % 2 == 0
    partner = (rank + 1) % world if leader else (rank - 1) % world
    buf = torch.zeros(nbytes // 4, device=device)  # type: ignore[arg-type]
    times = []
    for i in range(repeats + 1):  # the first round sets up the connection
        dist.barrier()
        start = time.perf_counter()
        if not alone:
            if leader:
                dist.send(buf, partner)
                dist.recv(buf, partner)
            else:
                dist.recv(buf, partner)
                dist.send(buf, partner)
        sync_device(buf)
        if i >= 1:
            times.append(time.perf_counter() - start)
    return statistics.median(times) / 2 if not alone else 0.0


def _two_point(small_bytes: float, small_s: float, big_bytes: float,
               big_s: float) -> tuple[float, float]:
    """latency + bytes / bandwidth through two measurements (the small one ~ the latency). A
    small message delayed by a busy machine must not make the large one look instant: the
    latency is taken as at most half the large message's time."""
    latency = max(min(small_s, big_s / 2), 0.0)
    slope = (big_s - latency) / (big_bytes - small_bytes) if big_bytes > small_bytes else 0.0
    return latency, 1.0 / max(slope, 1e-15)


def timed_allreduce(grads: list[Any], world: int, repeats: int) -> float:
    import torch
    import torch.distributed as dist

    times = []
    for i in range(repeats + 2):
        dist.barrier()
        start = time.perf_counter()
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= world
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))
        sync_device(flat)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def sync_device(buf: object) -> None:
    import torch

    if getattr(buf, "is_cuda", False):
        torch.cuda.synchronize()
