"""How long transfers take: links by placement and the ring all-reduce.

Placement (what the runtime does): replica r runs stages on ranks r*P .. r*P + P - 1, ranks fill
nodes in order. A pipeline link is intra-node when, for every replica, both of its stages sit on
one node; the replicas of a stage are P ranks apart, so their all-reduce stays on one node only
when the whole job does. In a launched job the measured links (``world/network.py``:
``measure_network``) replace the stated numbers.

Virtual stages (several stages per rank) are priced where their traffic lands
(``rank_links``, ``rank_allreduce``): the simulator times a virtual schedule on its ranks
(``schedule/simulate.py``), a boundary between two stages of one rank costs nothing, boundaries
between the same two ranks queue on that pair's wire. So the looped placement (interleaved 1F1B)
sends across every one of its ``v P - 1`` boundaries, about v times 1F1B's bytes; the V shape
(ZB-V) keeps the turn at the last rank local, about twice. The all-reduce after the step is per
rank: a rank all-reduces the gradients of all its stages (the largest rank sets the time), and a
tied weight whose copies all sit on one rank (GPT's embedding and head under the V shape) needs
no cross-rank sum.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..schedule import Schedule
from ..world.network import NetworkProfile
from .balance import PartitionCosts
from .cluster import Cluster


@dataclass(frozen=True)
class Links:
    """Transfer costs of one (P, D) placement."""

    bandwidths: list[float]  # per pipeline link s -> s+1
    latency: float
    partition_bandwidth: float  # one number for the partitioner's send-time term
    allreduce_bandwidth: float
    allreduce_latency: float
    # per pipeline link: whether it joins two nodes (a slow link: ``compression="auto"``
    # considers compressing only those); whether a stage's replicas span nodes
    slow: tuple[bool, ...] = ()
    allreduce_slow: bool = False

    def is_slow(self, link: int) -> bool:
        return bool(self.slow[link]) if link < len(self.slow) else False

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
    """The links of ``stages`` x ``replicas`` ranks placed replica-major (rank r*P + s) on
    ``cluster``'s nodes (``gpus_per_node`` consecutive ranks each). A link is slow when it
    joins two nodes. ``network`` (measured): its per-link bandwidths where it measured every
    link this placement uses (the slowest replica's per boundary), else its slowest link's."""
    intra, inter = float(cluster.intra_node_bandwidth), float(cluster.inter_node_bandwidth)
    per_node = cluster.gpus_per_node
    # link s of replica r joins ranks r*P + s and r*P + s + 1: it crosses a node boundary when
    # r*P + s + 1 is a multiple of per_node; r*P mod per_node repeats within per_node replicas
    starts = {(r * stages) % per_node for r in range(min(replicas, per_node))}
    slow = tuple(per_node == 1 or (-(s + 1)) % per_node in starts for s in range(stages - 1))
    one_node = replicas > 1 and stages * replicas <= per_node
    replica_slow = replicas > 1 and not one_node
    if network is not None:
        per_message = network.allreduce_latency / max(1, 2 * (network.world_size - 1))
        bandwidths = [network.bandwidth] * (stages - 1)
        latency = network.latency
        measured = network.link_bandwidths
        if measured and stages * replicas <= len(measured) + 1:
            bandwidths = [min(measured[r * stages + s] for r in range(replicas))
                          for s in range(stages - 1)]
            latency = max(network.link_latencies[r * stages + s] for r in range(replicas)
                          for s in range(stages - 1)) if stages > 1 else latency
        return Links(bandwidths, latency, min(bandwidths, default=network.bandwidth),
                     network.allreduce_bandwidth, per_message, slow, replica_slow)
    return Links(
        bandwidths=[inter if is_slow else intra for is_slow in slow],
        latency=float(cluster.latency),
        partition_bandwidth=intra if per_node > 1 else inter,
        allreduce_bandwidth=intra if one_node else inter,
        allreduce_latency=float(cluster.latency),
        slow=slow, allreduce_slow=replica_slow,
    )


def rank_links(net: Links, schedule: Schedule) -> Links:
    """``net`` (the links of the schedule's R ranks) per stage boundary: the slowest link
    between the two ranks it joins (a boundary inside one rank is never sent)."""
    ranks = [schedule.rank_of(s) for s in range(schedule.num_stages)]
    bandwidths = []
    for a, b in zip(ranks, ranks[1:]):
        lo, hi = sorted((a, b))
        bandwidths.append(min(net.bandwidths[lo:hi]) if lo != hi else math.inf)
    slow = [any(net.slow[lo:hi]) if lo != hi else False
            for lo, hi in (sorted((a, b)) for a, b in zip(ranks, ranks[1:]))]
    return dataclasses.replace(net, bandwidths=bandwidths, slow=tuple(slow))


def rank_allreduce(net: Links, plan: PartitionCosts, schedule: Schedule, replicas: int) -> float:
    """Seconds of the step's gradient reductions with the stages on ``schedule``'s ranks: each
    rank's gradients over the replicas (the largest rank's), plus the tied weights whose copies
    are on several ranks."""
    per_rank = np.zeros(schedule.num_ranks)
    for s, grads in enumerate(plan.grads):
        per_rank[schedule.rank_of(s)] += float(grads)
    tied = 0.0
    for grad, stages in plan.shared_holders:
        # plan.grads counts a copy per holder stage; the copies on one rank are one tensor
        on = Counter(schedule.rank_of(s) for s in stages)
        for r, copies in on.items():
            per_rank[r] -= (copies - 1) * grad
        if len(on) > 1:
            tied += grad
    return net.allreduce(float(per_rank.max()), replicas) + net.allreduce(tied, 2)
