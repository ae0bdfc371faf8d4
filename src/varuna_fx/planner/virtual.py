"""The planner's view of virtual stages (several stages per rank): what their links and
all-reduces cost, and whether one beats the chosen one-stage-per-rank layout.

The simulator times a virtual schedule on its ranks (``schedule/simulate.py``): a boundary
between two stages of one rank costs nothing, boundaries between the same two ranks queue on
that pair's wire. So the traffic a placement adds is priced where it lands: the looped
placement (interleaved 1F1B) sends across every one of its ``v P - 1`` boundaries, about v
times 1F1B's bytes; the V shape (ZB-V) keeps the turn at the last rank local, about twice. On a
slow link that traffic outweighs the smaller bubble, and the planner keeps v = 1.

The all-reduce after the step is per rank: a rank all-reduces the gradients of all its stages
(the largest rank sets the time), and a tied weight whose copies all sit on one rank (GPT's
embedding and head under the V shape) needs no cross-rank sum.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any

import numpy as np

from ..schedule import Schedule, ScheduleSpec, peak_stash_counts, virtual_choices
from .balance import PartitionCosts
from .candidates import Candidate
from .network import Links


def rank_links(net: Links, schedule: Schedule) -> Links:
    """``net`` (the links of the schedule's R ranks) per stage boundary: the slowest link
    between the two ranks it joins (a boundary inside one rank is never sent)."""
    ranks = [schedule.rank_of(s) for s in range(schedule.num_stages)]
    bandwidths = []
    for a, b in zip(ranks, ranks[1:]):
        lo, hi = sorted((a, b))
        bandwidths.append(min(net.bandwidths[lo:hi]) if lo != hi else math.inf)
    return dataclasses.replace(net, bandwidths=bandwidths)


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


def weigh(planner: Any, best: Candidate) -> list[tuple[Candidate, Schedule]]:
    """Each virtual schedule (``virtual_choices``, at its default v) on ``best``'s ranks, D and
    micro-batch size, priced as :func:`on_ranks` prices it, where it fits. ``planner``: the
    search's ``Planner``."""
    found = []
    for kind in virtual_choices():
        stages = kind.stages_per_rank * best.stages
        if best.stages < 2 or stages > planner.balancer(best.micro_batch_size).count:
            continue
        priced = on_ranks(planner, best, kind)
        if priced is not None:
            found.append(priced)
    return found


def on_ranks(planner: Any, ranks: Candidate, kind: ScheduleSpec
             ) -> tuple[Candidate, Schedule] | None:
    """The schedule ``kind`` on the R ranks (``ranks.stages``), D and micro-batch size of
    ``ranks``, with its v stages per rank: the candidate of ``v R`` stages, partitioned for the
    schedule's stash counts with each stage at 1/v of the memory, priced with its schedule;
    None when no partition fits. ``planner``: the search's ``Planner``."""
    v, b, m = kind.stages_per_rank, ranks.micro_batch_size, ranks.num_micro_batches
    stages = v * ranks.stages
    c = Candidate(stages, ranks.data_parallel, b, m, schedule=kind.name)
    before = planner.stages_per_rank
    planner.stages_per_rank = v
    try:
        sched, counts = planner.built(stages, m, kind)
    finally:
        planner.stages_per_rank = before
    c.stash_counts, c.exact = tuple(counts), True
    c.plan = planner.partition(b, stages, c.stash_counts, planner.memory_cap / v)
    if c.plan is None:
        return None
    c.memory = tuple(float(x) for x in c.plan.memory(peak_stash_counts(sched),
                                                    planner.recompute))
    planner.simulated(c, sched)
    return c, sched
