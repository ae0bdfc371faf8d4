"""Auto-configuration: the fastest (P, D, micro-batch size) for a cluster and a batch.

Every candidate with P x D <= GPUs (P up to the number of places the model can be cut), D
dividing the global batch and a micro-batch size dividing the per-replica batch is weighed by
time per sample (with a fixed global batch: by step time). Evaluating one fully costs a
partition, a memory check and a schedule simulation, and there are up to ~10^4 candidates for a
1024-GPU cluster, so the search is a best-first branch and bound. Every candidate enters a heap
keyed by a floor (a lower bound, ``floors.py``) of its time per sample, and popping the smallest
key refines it one level and pushes it back:

0. from totals only: ``max(m * bottleneck floor, one micro-batch through the whole model,
   ...) + the all-reduce of the largest unit's gradients``;
1. partitioned (cost arrays depend only on b, partitions only on (b, P): both memoized):
   ``max_s [fill before stage s + m * busy_s + drain after it] + all-reduce``;
   at 0 and 1 also the link queue (``floors.link_queue``): one micro-batch's round trip
   plus m - 1 messages queued on the slowest link, which binds for deep pipelines with
   many micro-batches on slow links (with the partition's own cuts where no order can
   make the search re-partition it);
2. checked against memory with the schedule's real stash counts (re-partitioned to fit if
   needed), and floored by Little's law (stage s holds at most k_s micro-batches, each for at
   least its forward-to-backward round trip);
3. simulated (``schedule.simulate``) plus the all-reduce: final.

A candidate popped at level 3 is faster than every floor left in the heap, so the first ``top``
popped are the top of the whole space, exactly as evaluating everything would rank them (tested)
-- after a few hundred partitions and a handful of simulations instead of ~10^4 of each.

``schedule="auto"`` adds the schedule to the search: after a candidate is partitioned (its
floors so far hold for every schedule, the split backward's with only the input-gradient part
on the chain back) it branches into one candidate per schedule it weighs
(``schedule.weighed_schedules``), each checked against memory with its own order's stash counts
and simulated with its own order; ties go to the schedule registered first (plain before split
backward). With P given on one device (nothing to search) ``Planner.best_schedule`` simulates
each schedule for that configuration. The exact partition (``passes/partition.py``) is then
made for the chosen configuration and simulated once more by ``configure.price`` for
``Plan.predicted_step_time``.

The search is the heap and its levels only: a ``Planner`` holds a ``pricing.Pricer`` (the model on
the cluster under one setting: partitions, orders, memory checks, simulated steps) and keys its
heap by the floors of ``floors.py``, functions of that pricer and a candidate.

Speed (bench/RESULTS.md, "Planner speed"): making orders was most of the search until the
generators timed each order as they made it, a finalist was first simulated with the "quick"
generator (three of the six rule variants, within a few percent of the full set: it waits at
``e / (1 + QUICK_SLACK)``) and the link-queue floor cut hopeless deep pipelines on slow links,
each choosing bit for bit what the plain search chooses (``tests/planner/test_fast_paths.py``).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time

from ..costs.roofline import DeviceSpec
from ..costs.wire import ReplicaSync
from ..errors import PartitionError
from ..passes.partition import held_together
from ..schedule import ScheduleSpec
from ..world.network import NetworkProfile
from . import floors
from .candidates import QUICK_SLACK, Candidate, SearchResult, Space, divisors
from .cluster import Cluster
from .cost_table import CostTable
from .pricing import Pricer
from .steady import simplicity, tied


class Planner:
    """Searches one model's configurations on one cluster (branch and bound, above), pricing
    them with its ``pricer`` (made here from the arguments, as ``Pricer.build`` takes them)."""

    def __init__(self, table: CostTable, cluster: Cluster, *, schedule: str | ScheduleSpec,
                 recompute: bool,
                 spec: DeviceSpec | None = None, network: NetworkProfile | None = None,
                 shard_optimizer: bool | str = False,
                 stages_per_rank: int | None = None, compression: str = "off",
                 replica_sync: ReplicaSync = "exact") -> None:
        self.pricer = Pricer.build(table, cluster, schedule=schedule, recompute=recompute,
                                   spec=spec, network=network, shard_optimizer=shard_optimizer,
                                   stages_per_rank=stages_per_rank, compression=compression,
                                   replica_sync=replica_sync)
        # ties go to the schedule weighed first (see _key)
        self._rank = {kind.name: k for k, kind in enumerate(self.pricer.schedules)}

    def candidates(self, space: Space) -> list[Candidate]:
        table = self.pricer.table
        most = table.num_units
        if space.stages is not None:
            if space.stages > most:
                raise PartitionError(
                    f"stages={space.stages} is more than the {most} places the model can be cut "
                    f"(operations of the model between cuts): use at most {most} stages"
                    f"{held_together(table.written_spans, len(table.names))}"
                )
            depths: list[int] = [space.stages]
        else:
            depths = list(range(1, min(most, space.gpus) + 1))
        found = []
        for p in depths:
            widths = [space.data_parallel] if space.data_parallel is not None else \
                range(1, max(1, space.gpus // p) + 1)
            if space.world is not None:
                widths = [d for d in widths if p * d == space.world]
            elif space.gpus > 1:  # (one device may time-share an explicit P for exploration)
                widths = [d for d in widths if p * d <= space.gpus]
            for d in widths:
                batch = space.replica_batch(d)
                if batch is None:
                    continue
                if space.micro_batches is not None:  # grad_accum_steps: b follows from D
                    sizes = [batch // space.micro_batches] if batch % space.micro_batches == 0 \
                        and space.micro_batch_size in (None, batch // space.micro_batches) \
                        else []
                else:
                    sizes = [space.micro_batch_size] if space.micro_batch_size is not None \
                        else divisors(batch)
                found += [Candidate(p, d, b, batch // b) for b in sizes if batch % b == 0]
        return found

    def search(self, space: Space, top: int = 5, exact: int = 1,
               tolerance: float = 0.0) -> SearchResult:
        """The ``top`` fastest candidates, best first. ``tolerance`` > 0 (compile and
        ``plan_for`` pass ``steady.TIE_TOLERANCE``): the first is the simplest of those
        within it of the fastest (``settle``), the others follow in order. The first ``exact`` are simulated with
        the order the full generator makes from their own costs (what the plan would run);
        the others may keep a cheaper generator's estimate (``Candidate.estimated``: an
        order at most as fast, so the row is no better than the plan would be).

        How the exact rows stay exact: a candidate is first simulated with the "quick"
        order, whose step e is at most QUICK_SLACK above the full order's, so it waits in
        the heap at max(its floor, e / (1 + QUICK_SLACK)), a floor of its full step;
        popped there while exact rows are missing, it gets the full order. Once they are
        found, what is left only fills the listed rows: the "quick" order's step (so that
        a row does not depend on whether it was popped before or after the exact ones),
        or the "rough" one's where the candidate's own partition is certainly slower than
        its key (``_suspect``: far down the list or off it)."""
        start = time.perf_counter()
        pricer = self.pricer
        result = SearchResult(top=[])
        pool = self.candidates(space)
        result.considered = len(pool) * len(pricer.schedules)
        order = itertools.count()
        heap = [(self._key(floor, c), next(order), 0, c)
                for floor, c in zip(floors.all_from_totals(pricer, pool), pool)]
        heapq.heapify(heap)

        def push(seconds: float, level: int, c: Candidate) -> None:
            c.floor = seconds
            heapq.heappush(heap, (self._key(seconds, c), next(order), level, c))

        while heap and len(result.top) < top:
            _, _, level, c = heapq.heappop(heap)
            if level == 4:  # simulated, and no other candidate can be faster
                result.top.append(c)
            elif level == 3:  # estimated: the full order, while the top needs exact rows
                if len(result.top) < exact and c.estimated:
                    step = pricer.finish(c)
                    if step is not None:
                        push(step, 4, c)
                else:
                    push(c.step_time, 4, c)
            elif level == 0:
                c.plan = pricer.plan_candidate(c, c.stash_counts)
                result.partitioned += 1
                if c.plan is not None:
                    push(floors.from_stages(pricer, c), 1, c)
            elif level == 1:
                # "auto": one candidate per schedule from here (memory and the stash floor
                # depend on the schedule); a candidate re-partitioned for one keeps it
                for one in self._branches(c):
                    if one.stages > 1 and pricer.kind(one.schedule).cost_aware:
                        # its order (and the micro-batches it holds) comes from its own costs:
                        # memory is checked with those counts when it is generated (finish);
                        # a unit-cost order made here just for its counts cost as much
                        push(floors.from_stages(pricer, one), 2, one)
                        continue
                    _, counts = pricer.built(one.stages, one.num_micro_batches, one.schedule)
                    if not pricer.fits(one, counts):
                        if not one.exact and pricer.fit(one, counts):  # re-partitioned
                            push(floors.from_stages(pricer, one), 1, one)
                        continue
                    push(max(floors.from_stages(pricer, one),
                             floors.from_stash(pricer, one, counts)), 2, one)
            else:  # level 2: simulated, with a cheaper order first where there is one
                result.simulated += 1
                floor = c.floor
                if not pricer.has_quick(c):
                    step = pricer.finish(c)
                    if step is not None:
                        push(step, 4, c)
                elif len(result.top) < exact:  # may be among the exact rows: bounded estimate
                    step = pricer.finish(c, "quick")
                    if step is not None and c.estimated:
                        push(max(floor, step / (1 + QUICK_SLACK)), 3, c)
                    elif step is not None:  # (the quick order is the full one)
                        push(step, 4, c)
                else:  # only listed: the quick estimate is its row, or the rough one
                    # where its own partition cannot be fast (see ``_suspect``)
                    step = pricer.finish(c, "rough" if self._suspect(c, floor) else "quick")
                    if step is not None:
                        push(step, 4, c)
        if tolerance > 0:
            self.settle(result, tolerance)
        result.seconds = time.perf_counter() - start
        result.alternatives = [c.alternative(i == 0) for i, c in enumerate(result.top)]
        return result

    def settle(self, result: SearchResult, tolerance: float) -> None:
        """Put first, in ``result.top``, the simplest candidate (``steady.simplicity``: fewest
        devices, stages, then the largest micro-batch, the schedule weighed first) among those
        whose time per sample is within ``tolerance`` of the fastest: a difference the
        measurements cannot tell apart does not flip the pick. The one moved first is
        simulated with the full order where its row was a cheaper estimate (never slower than
        the estimate, so it stays within the tolerance)."""
        if len(result.top) < 2:
            return
        fastest = result.top[0].step_time / result.top[0].samples
        per_sample = [c.step_time / c.samples for c in result.top]
        within = tied(per_sample, tolerance)
        pick = min(within, key=lambda i: self._simplicity(result.top[i]))
        if pick == 0:
            return
        chosen = result.top[pick]
        if chosen.estimated:
            step = self.pricer.finish(chosen)
            if step is None or step / chosen.samples > fastest * (1 + tolerance):
                return  # (cannot happen: the full order is never slower than its estimate)
        result.top.insert(0, result.top.pop(pick))
        result.settled = True

    def _simplicity(self, c: Candidate) -> tuple[int, int, int, int]:
        return simplicity(c.stages, c.data_parallel, c.micro_batch_size,
                          self._rank.get(c.schedule, 0))

    def _suspect(self, c: Candidate, floor: float) -> bool:
        """Whether ``c``'s step is above ``floor`` for certain if its partition is not made
        again for an order's stash counts (its own cuts queue on a slow link, see
        ``floors.plan_queue``): its row then gets the rough estimate, as it will be far down the
        list or off it (72 MiB crossing 1 Gbit/s per micro-batch: the quick orders of such
        deep pipelines were most of a memory-tight search on a slow link)."""
        return self._key(floors.from_stages(self.pricer, c, final=True), c) > \
            self._key(floor, c)

    def best_schedule(self, c: Candidate) -> str:
        """The schedule ``c`` (P, D, b, m; given, not searched) runs fastest with, among those
        that fit (partitioned as the search would; within the tie tolerance, the first
        weighed); the first weighed when none does."""
        pricer = self.pricer
        if len(pricer.schedules) == 1:
            return pricer.schedules[0].name
        c.plan = pricer.plan_candidate(c)
        if c.plan is None:
            return pricer.schedules[0].name
        timed = []
        for one in self._branches(c):
            _, counts = pricer.built(one.stages, one.num_micro_batches, one.schedule)
            if pricer.fits(one, counts) or pricer.fit(one, counts):
                timed.append((self._key(pricer.simulated(one, pricer.ordered(one)), one),
                              one.schedule))
        if not timed:
            return pricer.schedules[0].name
        # near-ties (steady.TIE_TOLERANCE) go to the schedule weighed first
        within = tied([key[0] for key, _ in timed])
        return min((timed[i] for i in within), key=lambda t: self._rank.get(t[1], 0))[1]

    def _branches(self, c: Candidate) -> list[Candidate]:
        """``c`` for each schedule the planner weighs (``c`` itself once it has one)."""
        if c.schedule:
            return [c]
        # one stage runs its micro-batches in order under any schedule: weighing them all
        # only listed the same configuration once per name
        schedules = self.pricer.schedules
        if len(schedules) == 1 or c.stages == 1:
            c.schedule = schedules[0].name
            return [c]
        return [dataclasses.replace(c, schedule=kind.name) for kind in schedules]

    def _key(self, seconds: float, c: Candidate) -> tuple[float, int, int, int, int]:
        """Time per sample; ties go to fewer devices, fewer stages, bigger micro-batches,
        then the schedule listed first (plain before split backward)."""
        per_sample = float(f"{seconds / c.samples:.9g}")
        rank = self._rank.get(c.schedule, 0)
        return (per_sample, c.stages * c.data_parallel, c.stages, -c.micro_batch_size, rank)
