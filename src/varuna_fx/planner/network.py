"""How long transfers take: links by placement, ring all-reduce, and a quick measurement.

Placement (what the runtime does): replica r runs stages on ranks r*P .. r*P + P - 1, ranks fill
nodes in order. A pipeline link is intra-node when, for every replica, both of its stages sit on
one node; the replicas of a stage are P ranks apart, so their all-reduce stays on one node only
when the whole job does. When the job is already running distributed, :func:`measure_network`
replaces the stated numbers with a ping-pong and an all-reduce timed over the process group.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..world.where import (
    NetworkProfile,
    in_process_group,
    quick_network,
    sync_device,
    timed_allreduce,
)
from .cluster import Cluster

# NetworkProfile and quick_network live in ``where`` (Cluster.local measures with them)
__all__ = ["Links", "NetworkProfile", "links", "measure_network", "quick_network"]


@dataclass(frozen=True)
class Links:
    """Transfer costs of one (P, D) placement."""

    bandwidths: list[float]  # per pipeline link s -> s+1
    latency: float
    partition_bandwidth: float  # one number for the partitioner's send-time term
    allreduce_bandwidth: float
    allreduce_latency: float

    @cached_property  # the planner asks once per candidate (10^4 at 1024 devices)
    def inverse_bandwidth(self) -> float:
        """Sum over the pipeline links of 1 / bandwidth (seconds per byte across them all)."""
        return sum(1.0 / bw for bw in self.bandwidths)

    def allreduce(self, nbytes: float, replicas: int) -> float:
        """Ring all-reduce of ``nbytes`` over ``replicas``: 2 (D-1)/D of the bytes cross the
        slowest link, in 2 (D-1) steps."""
        if replicas <= 1 or nbytes <= 0:
            return 0.0
        ring = 2 * (replicas - 1)
        return ring / replicas * nbytes / self.allreduce_bandwidth + ring * self.allreduce_latency

    def allreduce_terms(self, replicas: int) -> tuple[float, float]:
        """(seconds per byte, seconds per all-reduce) of ``allreduce``: (0, 0) for one
        replica. The partition weighs each stage's all-reduce with them."""
        if replicas <= 1:
            return 0.0, 0.0
        ring = 2 * (replicas - 1)
        return ring / replicas / self.allreduce_bandwidth, ring * self.allreduce_latency


def links(cluster: Cluster, stages: int, replicas: int,
          network: NetworkProfile | None = None) -> Links:
    intra, inter = float(cluster.intra_node_bandwidth), float(cluster.inter_node_bandwidth)
    if network is not None:
        per_message = network.allreduce_latency / max(1, 2 * (network.world_size - 1))
        return Links([network.bandwidth] * (stages - 1), network.latency, network.bandwidth,
                     network.allreduce_bandwidth, per_message)
    per_node = cluster.gpus_per_node
    # link s of replica r joins ranks r*P + s and r*P + s + 1: it crosses a node boundary when
    # r*P + s + 1 is a multiple of per_node; r*P mod per_node repeats within per_node replicas
    starts = {(r * stages) % per_node for r in range(min(replicas, per_node))}
    bandwidths = [inter if per_node == 1 or (-(s + 1)) % per_node in starts else intra
                  for s in range(stages - 1)]
    one_node = replicas > 1 and stages * replicas <= per_node
    return Links(
        bandwidths=bandwidths,
        latency=float(cluster.latency),
        partition_bandwidth=intra if per_node > 1 else inter,
        allreduce_bandwidth=intra if one_node else inter,
        allreduce_latency=float(cluster.latency),
    )


def measure_network(sizes: tuple[int, ...] = (2**18, 2**22, 2**24),
                    repeats: int = 8) -> NetworkProfile | None:
    """Ping-pong between ranks 0 and 1, and a gradient all-reduce over every rank done the way
    a runtime does it (flatten into one bucket, all-reduce, average, copy back), each at a few
    sizes, fitted as latency + bytes / bandwidth. Every rank must call it; None without a
    process group."""
    import torch
    import torch.distributed as dist

    if not in_process_group():
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) \
        if torch.cuda.is_available() and dist.get_backend() == "nccl" else torch.device("cpu")
    p2p, reduce = [], []
    for nbytes in sizes:
        grads = [torch.zeros(nbytes // 32, device=device) for _ in range(8)]
        p2p.append(_ping_pong(grads[0], rank, repeats) / 2)
        reduce.append(timed_allreduce(grads, world, repeats))
    lat, bw = _fit([s / 8 for s in sizes], p2p)
    factor = 2 * (world - 1) / world
    ar_lat, ar_bw = _fit([factor * s for s in sizes], reduce)
    # every rank uses rank 0's numbers, so all ranks plan the same configuration
    shared = [NetworkProfile(lat, bw, ar_lat, ar_bw, world)]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def _ping_pong(buf: object, rank: int, repeats: int) -> float:
    import torch.distributed as dist

    times = []
    for i in range(repeats + 2):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        sync_device(buf)
        if i >= 2:  # the first rounds set up connections
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fit(nbytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least squares ``seconds = latency + nbytes / bandwidth``."""
    slope, intercept = np.polyfit(np.asarray(nbytes), np.asarray(seconds), 1)
    return max(float(intercept), 0.0), 1.0 / max(float(slope), 1e-15)
