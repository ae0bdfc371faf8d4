"""Whether virtual stages (several stages per rank) beat the chosen one-stage-per-rank layout.

After the search picks (P, D, b) with one stage per rank, each virtual choice is priced on the
same ranks (``weigh``): ``v R`` stages, partitioned for the schedule's stash counts with each
stage at 1/v of the memory, simulated with the links and reductions of the ranks they run on
(``network.rank_links``, ``network.rank_allreduce``). On a slow link the traffic a placement adds
outweighs the smaller bubble, and the planner keeps v = 1.
"""

from __future__ import annotations

from ..schedule import Schedule, peak_stash_counts
from .candidates import Candidate
from .pricing import Pricer

# the virtual schedules (and v) a free choice weighs, for a layout of R ranks
CHOICES: tuple[tuple[str, int], ...] = (("interleaved-1f1b", 2), ("zbv", 2))


def weigh(pricer: Pricer, best: Candidate) -> list[tuple[Candidate, Schedule]]:
    """Each virtual choice for ``best``'s ranks, D and micro-batch size that fits: the
    candidate (``v R`` stages, partitioned for the schedule's stash counts with each stage at
    1/v of the memory) priced with its schedule. ``pricer``: the search's, one stage per rank."""
    found = []
    ranks, b, m = best.stages, best.micro_batch_size, best.num_micro_batches
    for name, v in CHOICES:
        stages = v * ranks
        if ranks < 2 or stages > pricer.balancer(b).count:
            continue
        c = Candidate(stages, best.data_parallel, b, m, schedule=name)
        sched, counts = pricer.per_rank(v).built(stages, m, name)
        c.stash_counts, c.exact = tuple(counts), True
        c.plan = pricer.partition(b, stages, c.stash_counts, pricer.memory_cap / v)
        if c.plan is None:
            continue
        c.memory = tuple(float(x) for x in c.plan.memory(peak_stash_counts(sched),
                                                        pricer.recompute))
        pricer.simulated(c, sched)
        found.append((c, sched))
    return found
