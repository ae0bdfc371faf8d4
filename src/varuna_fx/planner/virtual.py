"""Whether virtual stages (several stages per rank) beat the chosen one-stage-per-rank layout.

After the search picks (P, D, b) with one stage per rank, each virtual schedule is priced on the
same ranks (``weigh``, each as ``on_ranks`` prices it): ``v R`` stages, partitioned for the
schedule's stash counts with each stage at 1/v of the memory, simulated with the links and
reductions of the ranks they run on (``network.rank_links``, ``network.rank_allreduce``). On a
slow link the traffic a placement adds outweighs the smaller bubble, and the planner keeps v = 1.
"""

from __future__ import annotations

from ..schedule import Schedule, ScheduleSpec, peak_stash_counts, virtual_choices
from .candidates import Candidate
from .pricing import Pricer


def weigh(pricer: Pricer, best: Candidate) -> list[tuple[Candidate, Schedule]]:
    """Each virtual schedule (``virtual_choices``, at its default v) on ``best``'s ranks, D and
    micro-batch size, priced as :func:`on_ranks` prices it, where it fits. ``pricer``: the
    search's, one stage per rank."""
    found = []
    for kind in virtual_choices():
        stages = kind.stages_per_rank * best.stages
        if best.stages < 2 or stages > pricer.balancer(best.micro_batch_size).count:
            continue
        priced = on_ranks(pricer, best, kind)
        if priced is not None:
            found.append(priced)
    return found


def on_ranks(pricer: Pricer, ranks: Candidate, kind: ScheduleSpec
             ) -> tuple[Candidate, Schedule] | None:
    """The schedule ``kind`` on the R ranks (``ranks.stages``), D and micro-batch size of
    ``ranks``, with its v stages per rank: the candidate of ``v R`` stages, partitioned for the
    schedule's stash counts with each stage at 1/v of the memory, priced with its schedule;
    None when no partition fits. ``pricer``: one stage per rank (the search's); the schedule
    is built by its ``per_rank(v)``."""
    v, b, m = kind.stages_per_rank, ranks.micro_batch_size, ranks.num_micro_batches
    stages = v * ranks.stages
    c = Candidate(stages, ranks.data_parallel, b, m, schedule=kind.name)
    sched, counts = pricer.per_rank(v).built(stages, m, kind)
    c.stash_counts, c.exact = tuple(counts), True
    c.plan = pricer.partition(b, stages, c.stash_counts, pricer.memory_cap / v)
    if c.plan is None:
        return None
    c.memory = tuple(float(x) for x in c.plan.memory(peak_stash_counts(sched),
                                                    pricer.recompute))
    pricer.simulated(c, sched)
    return c, sched
