"""Measuring the links between the ranks of a running job: the one network probe.

``Cluster.local()`` (and so ``vf.compile`` with ``cluster=None``) calls :func:`measure_network`
in a launched job; the planner and the partitioner price transfers with the
:class:`NetworkProfile` it returns (``planner/network.py`` turns it into per-link costs), and a
profile carries it so every rank plans with rank 0's numbers. Bottom layer, beside ``where``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class NetworkProfile:
    """Measured transfer costs: ``latency + bytes / bandwidth`` per message, and an all-reduce
    fitted as ``allreduce_latency + 2 (D-1)/D * bytes / allreduce_bandwidth``."""

    latency: float
    bandwidth: float
    allreduce_latency: float
    allreduce_bandwidth: float
    world_size: int = 2
    # per link r -> r + 1 (world - 1 of them; empty when not measured per pair): what the
    # slowest-link numbers above summarise, so a plan prices each pipeline boundary by the
    # link it crosses (``planner/network.py``)
    link_latencies: tuple[float, ...] = ()
    link_bandwidths: tuple[float, ...] = ()

    def __post_init__(self) -> None:  # (a profile read back from JSON holds lists)
        object.__setattr__(self, "link_latencies", tuple(float(x) for x in self.link_latencies))
        object.__setattr__(self, "link_bandwidths",
                           tuple(float(x) for x in self.link_bandwidths))


def measure_network(target: float = 0.03, largest: int = 2**24,
                    smallest: int = 2**10) -> NetworkProfile | None:
    """The links this job will use, measured in about a second: neighbouring ranks ping-pong
    (pairs (0, 1), (2, 3), ... then (1, 2), (3, 4), ...: every link r -> r + 1 a pipeline
    uses, each timed on its own and kept: ``link_bandwidths``), first a tiny message (the latency), then messages growing 64x then 4x until one
    way takes ``target`` seconds (a slow link is timed with about a MiB, a fast one with up to
    ``largest`` bytes); then an all-reduce of the small and a large size. One direction at a
    time, as a pipeline mostly sends: on a shaped link, traffic both ways at once also queues
    each direction's acknowledgements behind the other's data (bench/RESULTS.md, "Commodity
    links"). Each timing is the slowest rank's median, agreed with an
    all-reduce of the maxima, so every rank derives the same numbers (the slowest link
    decides). Every rank must call it; None without a process group of 2+."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) \
        if torch.cuda.is_available() and dist.get_backend() == "nccl" else torch.device("cpu")

    def agreed(seconds: float) -> float:
        slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return float(slowest.item())

    def one_way(nbytes: int, repeats: int) -> tuple[float, list[float]]:
        """(the slowest link's time, every link r -> r + 1's time), agreed by all ranks."""
        offsets = (0, 1) if world > 2 else (0,)
        per_link = torch.zeros(world - 1, dtype=torch.float64, device=device)
        for k in offsets:
            seconds = _pair_ping_pong(nbytes, rank, world, k, device, repeats)
            leader = (rank - k) % world % 2 == 0
            if leader and rank + 1 < world and seconds > 0:  # this rank's link to rank + 1
                per_link[rank] = seconds
        dist.all_reduce(per_link, op=dist.ReduceOp.MAX)
        times = [float(x) for x in per_link.cpu()]
        return max(times), times

    small, small_links = one_way(smallest, 5)
    size, big, big_links = smallest, small, small_links
    while size < largest and big < target:
        size = min(largest, size * 64 if size == smallest else size * 4)
        big, big_links = one_way(size, 2)
    latency, bandwidth = _two_point(smallest, small, size, big)
    fitted = [_two_point(smallest, s, size, b) for s, b in zip(small_links, big_links)]
    factor = 2 * (world - 1) / world
    reduce_size = max(smallest * 4, size // 4)
    ar_small = agreed(timed_allreduce([torch.zeros(smallest // 4, device=device)], world, 3))
    ar_big = agreed(timed_allreduce([torch.zeros(reduce_size // 4, device=device)], world, 2))
    ar_latency, ar_bandwidth = _two_point(factor * smallest, ar_small,
                                          factor * reduce_size, ar_big)
    return NetworkProfile(latency, bandwidth, ar_latency, ar_bandwidth, world,
                          tuple(f[0] for f in fitted), tuple(f[1] for f in fitted))


def _pair_ping_pong(nbytes: int, rank: int, world: int, offset: int, device: object,
                    repeats: int) -> float:
    """Half the median round trip of ``nbytes`` between this rank and its partner: ranks
    ``offset + 2k`` and ``offset + 2k + 1`` (mod world) pair up; with an odd world one rank
    sits out (0.0)."""
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
    if getattr(buf, "is_cuda", False):
        torch.cuda.synchronize()
