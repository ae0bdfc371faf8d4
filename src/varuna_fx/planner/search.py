"""Auto-configuration: the fastest (P, D, micro-batch size) for a cluster and a batch.

Every candidate with P x D <= GPUs (P up to the number of places the model can be cut), D
dividing the global batch and a micro-batch size dividing the per-replica batch is weighed by
time per sample (with a fixed global batch: by step time). Evaluating one fully costs a
partition, a memory check and a schedule simulation, and there are up to ~10^4 candidates for a
1024-GPU cluster, so the search is a best-first branch and bound. Every candidate enters a heap
keyed by a lower bound of its time per sample, and popping the smallest key refines it one
level and pushes it back:

0. from totals only: ``max(m * bottleneck bound, one micro-batch through the whole model,
   ...) + the all-reduce of the largest unit's gradients``;
1. partitioned (cost arrays depend only on b, partitions only on (b, P): both cached):
   ``max_s [fill before stage s + m * busy_s + drain after it] + all-reduce``;
   at 0 and 1 also the link queue (``Planner._link_queue``): one micro-batch's round trip
   plus m - 1 messages queued on the slowest link, which binds for deep pipelines with
   many micro-batches on slow links (with the partition's own cuts where no order can
   make the search re-partition it);
2. checked against memory with the schedule's real stash counts (re-partitioned to fit if
   needed), and bounded by Little's law (stage s holds at most k_s micro-batches, each for at
   least its forward-to-backward round trip);
3. simulated (``schedule.simulate``) plus the all-reduce: final.

A candidate popped at level 3 is faster than every bound left in the heap, so the first ``top``
popped are the top of the whole space, exactly as evaluating everything would rank them (tested)
-- after a few hundred partitions and a handful of simulations instead of ~10^4 of each.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from ..costs.roofline import DeviceSpec
from ..errors import PartitionError
from ..passes.partition import held_together
from ..schedule import (
    Schedule,
    ScheduleCosts,
    build_schedule,
    cheaper,
    check_schedule_name,
    depends_on_costs,
    has_quick,
    is_split,
    peak_stash_counts,
    schedule_names,
    simulate,
    simulate_step,
)
from .balance import Balancer, StagePlan
from .cluster import Cluster
from .costs import CostTable, UnitArrays
from .network import Links, NetworkProfile, links
from .plan import Alternative


@dataclass
class Candidate:
    stages: int
    data_parallel: int
    micro_batch_size: int
    num_micro_batches: int
    plan: StagePlan | None = None
    # stash counts the partition was made for; None: one micro-batch per stage (a relaxation)
    stash_counts: tuple[int, ...] | None = None
    exact: bool = False  # partitioned with the schedule's real stash counts
    step_time: float = math.inf
    allreduce_time: float = 0.0
    bubble: float = 0.0
    memory: tuple[float, ...] = ()
    # the schedule it is priced with; "" until a schedule="auto" search branches it (after
    # partitioning: the bounds before that hold for every schedule)
    schedule: str = ""
    bound: float = 0.0  # seconds: the lower bound it was last pushed with
    estimated: bool = False  # step_time is a cheaper order's (see Planner.search)

    @property
    def samples(self) -> int:
        return self.data_parallel * self.micro_batch_size * self.num_micro_batches

    def alternative(self, chosen: bool = False) -> Alternative:
        return Alternative(self.stages, self.data_parallel, self.micro_batch_size,
                           self.num_micro_batches, self.step_time, self.bubble,
                           self.allreduce_time, self.memory, chosen, self.schedule)


@dataclass
class SearchResult:
    top: list[Candidate]  # best first
    considered: int = 0
    partitioned: int = 0
    simulated: int = 0
    seconds: float = 0.0
    alternatives: list[Alternative] = field(default_factory=list)

    @property
    def best(self) -> Candidate:
        return self.top[0]


@dataclass(frozen=True)
class Space:
    """What may vary: None means the planner chooses."""

    gpus: int
    example_batch: int
    global_batch_size: int | None = None
    stages: int | None = None
    data_parallel: int | None = None
    micro_batch_size: int | None = None
    world: int | None = None  # a running job: P x D must use exactly its ranks

    def replica_batch(self, replicas: int) -> int | None:
        if self.global_batch_size is None:
            return self.example_batch  # each replica steps on a batch like the example
        if self.global_batch_size % replicas:
            return None
        return self.global_batch_size // replicas


def weight_grads(backward: Sequence[float]) -> list[float]:
    """The weight-gradient part (``W``) of each stage's backward, for split-backward schedules:
    the first stage computes no input gradients (its inputs are the batch), so its whole
    backward is ``W`` and its ``B`` is free (measured on the GPT of bench_network.py: B 0.5 ms,
    W 160 ms); later stages about half (measured: 88 and 99 ms). With one stage, nothing
    is split."""
    values = [float(b) / 2 for b in backward]
    if len(values) > 1:
        values[0] = float(backward[0])
    return values


def divisors(n: int) -> list[int]:
    return list(_divisors(n))


@lru_cache(maxsize=256)
def _divisors(n: int) -> tuple[int, ...]:
    # (the search asks for every D's replica batch: 10^3 times, a handful of distinct ones)
    return tuple(d for d in range(1, n + 1) if n % d == 0)


AUTO = "auto"  # schedule=: let the planner choose among schedule_names()
# How much faster the full order generator may be than the quick one (the most measured:
# 2.1%; see schedule/varuna.py QUICK_VARIANTS): a quick estimate e bounds the full step
# below by e / (1 + QUICK_SLACK), which is what the search orders estimated candidates by.
QUICK_SLACK = 0.05
# ties (equal simulated steps, e.g. one stage) go to the first here: plain before split backward
_PREFERENCE = ("varuna", "1f1b", "gpipe", "varuna-zb", "1f1b-zb", "gpipe-zb")


def schedule_choices() -> list[str]:
    """What ``schedule=`` accepts: every schedule name, and "auto"."""
    return [*schedule_names(), AUTO]


def considered_schedules(schedule: str) -> list[str]:
    """The schedules a planner for ``schedule`` weighs: all of them for "auto"."""
    if schedule != AUTO:
        check_schedule_name(schedule)
        return [schedule]
    names = schedule_names()
    return sorted(names, key=lambda n: _PREFERENCE.index(n) if n in _PREFERENCE else len(names))


class Planner:
    """Searches one model's configurations on one cluster; caches partitions and schedules."""

    def __init__(self, table: CostTable, cluster: Cluster, *, schedule: str, recompute: bool,
                 spec: DeviceSpec | None = None, network: NetworkProfile | None = None) -> None:
        self.table = table
        self.cluster = cluster
        self.spec = spec or cluster.spec
        self.schedule = schedule  # a schedule name, or "auto": each candidate weighs them all
        self.schedules = considered_schedules(schedule)
        self._rank = {name: k for k, name in enumerate(self.schedules)}  # (ties: see _key)
        self.recompute = recompute
        self.network = network
        self.memory_cap = float(cluster.gpu_memory)
        self._balancers: dict[int, Balancer] = {}
        self._plans: dict[tuple[int, int, tuple[int, ...], float], StagePlan | None] = {}
        self._schedules: dict[tuple[str, int, int], tuple[Schedule, list[int]]] = {}
        self._links: dict[tuple[int, int], Links] = {}
        self._totals: dict[int, tuple[float, ...]] = {}
        self._hop_sums: dict[tuple[int, int, int], float] = {}

    # -- caches --------------------------------------------------------------------------------

    def balancer(self, b: int) -> Balancer:
        if b not in self._balancers:
            bw = links(self.cluster, 2, 1, self.network).partition_bandwidth
            units = self.table.unit_arrays(b, self.spec)
            self._balancers[b] = Balancer(units, self.table.shared, bw, self.recompute)
        return self._balancers[b]

    def balancer_for(self, units: UnitArrays, stages: int) -> Balancer:
        """A balancer over given unit arrays (one unit per stage of a made partition)."""
        bw = self.links(stages, 1).partition_bandwidth
        return Balancer(units, self.table.shared, bw, self.recompute)

    def partition(self, b: int, stages: int, stash_counts: int | tuple[int, ...] | None,
                  budget: float | None = None) -> StagePlan | None:
        """Fastest partition whose stages fit ``budget`` (default: the device memory) by the
        memory model, each stage holding its ``stash_counts`` micro-batches (one count for
        all, or per stage; None: one)."""
        budget = self.memory_cap if budget is None else budget
        counts = (stash_counts or 1,) * stages if not isinstance(stash_counts, tuple) \
            else stash_counts
        key = (b, stages, counts, budget)
        if key not in self._plans:
            self._plans[key] = self.balancer(b).partition(stages, budget, counts)
        return self._plans[key]

    def built(self, stages: int, micro_batches: int,
              schedule: str = "") -> tuple[Schedule, list[int]]:
        """The schedule (its compiled form is cached on it) and its per-stage stash counts,
        from unit costs. ``schedule``: a name (default: the planner's one schedule)."""
        name = schedule or self.schedules[0]
        key = (name, stages, micro_batches)
        if key not in self._schedules:
            sched = build_schedule(name, stages, micro_batches, self.recompute)
            self._schedules[key] = (sched, peak_stash_counts(sched))
        return self._schedules[key]

    def links(self, stages: int, replicas: int) -> Links:
        key = (stages, replicas)
        if key not in self._links:
            self._links[key] = links(self.cluster, stages, replicas, self.network)
        return self._links[key]

    def _totals_at(self, b: int, split: bool = False) -> tuple[float, ...]:
        """(all busy time, busy without recompute, largest unit without recompute, one
        micro-batch's forward + backward, gradient bytes, of the largest unit, the chain
        around the last unit, its busy time) at micro-batch size b. ``split``: for a
        split-backward schedule, whose chains need only the input-gradient part of each
        backward (not known per unit: the chains count forwards only)."""
        if (b, split) not in self._totals:
            u = self.balancer(b).units
            plain = u.recompute + u.backward
            chain = np.minimum(u.forward, u.recompute) + (0.0 if split else u.backward)
            # the last stage holds at least the last unit, and all other units' forward and
            # backward of one micro-batch chain around it
            last = float(chain.sum() - chain[-1]), float(plain[-1])
            self._totals[b, split] = (self.balancer(b).total, float(plain.sum()),
                                      float(plain.max(initial=0.0)), float(chain.sum()),
                                      float(u.grads.sum()), float(u.grads.max(initial=0.0)),
                                      *last)
        return self._totals[b, split]

    def _hops(self, b: int, stages: int, replicas: int) -> float:
        """One micro-batch crosses every link forward and back, with at least the smallest
        value any cut sends."""
        if stages == 1:
            return 0.0
        key = (b, stages, replicas)
        if key not in self._hop_sums:
            net = self.links(stages, replicas)
            self._hop_sums[key] = 2 * ((stages - 1) * net.latency
                                       + self._least_cut(b) * net.inverse_bandwidth)
        return self._hop_sums[key]

    def _slowest(self, stages: int, replicas: int) -> float:
        """Seconds per byte on the slowest pipeline link (0 with one stage)."""
        net = self.links(stages, replicas)
        return 1.0 / min(net.bandwidths) if net.bandwidths else 0.0

    def _least_cut(self, b: int) -> float:
        """The fewest bytes any cut sends at micro-batch size b."""
        cut = self.balancer(b).units.cut[1:-1]
        return float(cut.min()) if len(cut) else 0.0

    # -- the three keys ------------------------------------------------------------------------

    def bound_from_totals(self, c: Candidate) -> float:
        busy, plain, largest, chain, grads, unit_grads, around, last = \
            self._totals_at(c.micro_batch_size, self._split_bound(c) is not None)
        p, m = c.stages, c.num_micro_batches
        # the last stage does not recompute: some stage is busy >= (busy - its R) / P
        bottleneck = plain if p == 1 else max(largest, busy / (p + 1))
        hops = self._hops(c.micro_batch_size, p, c.data_parallel)
        pipeline = max(m * bottleneck, self._link_queue(c),
                       around + hops + m * last if p > 1 else 0.0)
        stage_grads = max(grads / p, unit_grads)
        return pipeline + self.links(p, c.data_parallel).allreduce(stage_grads, c.data_parallel)

    def bounds_from_totals(self, pool: Sequence[Candidate]) -> list[float]:
        """``bound_from_totals`` of every candidate at once: the search starts with 10^4-10^5
        of them, and one at a time this was a sixth of the search. The same operations on the
        same float64 values in the same order (numpy's arithmetic is IEEE's, as Python's), so
        the same bits; only what depends on (P, D) or on b alone is computed per value."""
        if not pool:
            return []
        p = np.array([c.stages for c in pool])
        d = np.array([c.data_parallel for c in pool])
        m = np.array([c.num_micro_batches for c in pool])
        # per micro-batch size: the totals and the smallest cut (hops), gathered by index
        sizes = sorted({c.micro_batch_size for c in pool})
        at = {b: k for k, b in enumerate(sizes)}
        size = np.array([at[c.micro_batch_size] for c in pool])
        split = [self._split_bound(c) is not None for c in pool]
        rows = [self._totals_at(b, True) + self._totals_at(b, False) for b in sizes]
        totals = np.array(rows)[size]  # [candidate, 16]: the split totals, then the plain
        picked = np.where(np.array(split)[:, None], totals[:, :8], totals[:, 8:])
        busy, plain, largest, chain, grads, unit_grads, around, last = picked.T
        least = np.array([self._least_cut(b) for b in sizes])[size]
        # per (P, D): the links
        pairs = sorted({(c.stages, c.data_parallel) for c in pool})
        where = {pair: k for k, pair in enumerate(pairs)}
        pair = np.array([where[c.stages, c.data_parallel] for c in pool])
        nets = [self.links(*one) for one in pairs]
        latency, inverse, ar_bw, ar_lat = (np.array(values)[pair] for values in zip(
            *((n.latency, n.inverse_bandwidth, n.allreduce_bandwidth, n.allreduce_latency)
              for n in nets)))
        slowest = np.array([self._slowest(*one) for one in pairs])[pair]
        bottleneck = np.where(p == 1, plain, np.maximum(largest, busy / (p + 1)))
        hops = np.where(p == 1, 0.0, 2 * ((p - 1) * latency + least * inverse))
        with np.errstate(invalid="ignore"):  # (0 * inf where it is not used)
            queue = np.where((p > 1) & (m > 1), (m - 1) * (least * slowest), 0.0)
        pipeline = np.maximum(np.maximum(m * bottleneck, chain + hops + queue),
                              np.where(p > 1, around + hops + m * last, 0.0))
        stage_grads = np.maximum(grads / p, unit_grads)
        ring = 2 * (d - 1)
        with np.errstate(divide="ignore", invalid="ignore"):  # (where no all-reduce runs)
            allreduce = np.where((d <= 1) | (stage_grads <= 0), 0.0,
                                 ring / d * stage_grads / ar_bw + ring * ar_lat)
        return (pipeline + allreduce).tolist()

    def bound_from_stages(self, c: Candidate, final: bool = False) -> float:
        """Level 1's key. ``final``: the partition is taken to be the one that will be
        simulated even where an order might make ``finish`` re-partition it (see
        ``search``: only for rows that are listed, not for the exact ones)."""
        plan = c.plan
        assert plan is not None
        net = self.links(c.stages, c.data_parallel)
        busy = plan.compute(self.recompute)
        hop = np.asarray([net.latency + nb / bw for nb, bw in zip(plan.send_bytes,
                                                                  net.bandwidths)])
        m = c.num_micro_batches
        fill = np.concatenate([[0.0], np.cumsum(plan.sim_forward(self.recompute)[:-1] + hop)])
        back = self._chain_backward(c)
        drain = np.concatenate([[0.0], np.cumsum(back[:-1] + hop)])
        # stage s starts after the forwards upstream, and after its last backward the
        # gradient runs back upstream; a split backward's W (busy - back) may overlap that
        later = np.maximum(m * busy, m * (busy - (plan.backward - back)) + drain) \
            if self._split_bound(c) else m * busy + drain
        pipeline = max(float(np.max(fill + later)), self._link_queue(c),
                       self._plan_queue(c, hop, back, final))
        return pipeline + self.allreduce(c)

    def _plan_queue(self, c: Candidate, hop: np.ndarray, back: np.ndarray,
                    final: bool = False) -> float:
        """``_link_queue`` with this partition's own bytes on each link, where the partition
        is the one that will be simulated (``final``, or ``_final``: it fits holding the
        most micro-batches any order can hold, so no order makes ``finish`` re-partition
        it); the same proof, each term now this partition's own. (The
        balancer prices every cut at the intra-node bandwidth, so a partition may send a
        large activation over a slow link: 72 MiB at 1 Gbit/s is 0.6 s per message, and
        those candidates' orders were most of a memory-tight search on a slow link.) 0
        where it may be re-partitioned. Kept a hair (1e-12 relative) below the sum, so that
        summation order never lifts it above the simulated step."""
        plan = c.plan
        assert plan is not None
        p, m = c.stages, c.num_micro_batches
        if p == 1 or m == 1 or not (final or self._final(c)):
            return 0.0
        net = self.links(p, c.data_parallel)
        wire = max(nb / bw for nb, bw in zip(plan.send_bytes, net.bandwidths))
        trip = float(plan.sim_forward(self.recompute).sum() + back.sum() + 2 * hop.sum())
        return (trip + (m - 1) * wire) * (1 - 1e-12)

    def _final(self, c: Candidate) -> bool:
        """Whether ``c``'s partition fits holding the most micro-batches any order of its
        schedule can hold (``_most_held``), so that no order makes ``finish`` re-partition
        it (a stage's peak grows with its stash count where its bytes are nonnegative)."""
        plan = c.plan
        assert plan is not None
        if np.any(plan.input_bytes < 0) or np.any(plan.activations < 0):
            return False
        most = plan.memory(self._most_held(c), self.recompute)
        return bool(np.all(most <= self.memory_cap))

    def _most_held(self, c: Candidate) -> list[int]:
        """Per stage, the most micro-batches an order of ``c``'s schedule can hold at once:
        m (no more exist), except on the last stage of Varuna's order, which holds one: its
        B is ready as its F ends and B goes before F (a split backward holds a micro-batch
        until its W, which may wait); a cost-free order's own counts where it is made
        already (not made for this: most candidates never need it). Before a
        schedule="auto" search branches ``c``: the most of any."""
        p, m = c.stages, c.num_micro_batches
        names = [c.schedule] if c.schedule else self.schedules
        most = [1] * p
        for name in names:
            if p > 1 and not depends_on_costs(name) and (name, p, m) in self._schedules:
                counts = self._schedules[name, p, m][1]
            elif p > 1 and name == "varuna":
                counts = [m] * (p - 1) + [1]
            else:
                counts = [m] * p
            most = [max(a, b) for a, b in zip(most, counts)]
        return most

    def _link_queue(self, c: Candidate) -> float:
        """One micro-batch's round trip through every stage and link, and the other m - 1
        queued on the slowest link: a lower bound of the pipeline part of any partition of
        ``c`` (the search may re-partition a candidate for memory after bounding it, so this
        must not depend on which cuts the partition picked).

        Why: a link carries one message at a time each way (``simulate``: the next waits
        until the previous one's bytes have crossed, ``bytes / bandwidth``; the latency
        overlaps), so on link s the m forward messages take at least ``m * wire_s`` from
        the first one's start to the last one's arrival. The first starts at the earliest
        when one micro-batch's forwards up to stage s and the links between are done; the
        last one's micro-batch then still runs its forwards after stage s, every backward
        (the part the stage upstream waits for) and crosses every link back. So a step
        lasts at least one round trip plus ``(m - 1) * wire_s`` (the backward direction
        gives the same sum). The round trip is at least ``chain + hops`` of
        ``_totals_at`` and ``_hops``; ``wire_s`` is at least the fewest bytes any cut
        sends over the slowest link's bandwidth. Slow links make this the binding bound of
        deep pipelines with many micro-batches, for which orders of 10^5 tasks were
        otherwise made (minutes of search at 1 Gbit/s and 8 GiB)."""
        b, p, m = c.micro_batch_size, c.stages, c.num_micro_batches
        chain = self._totals_at(b, self._split_bound(c) is not None)[3]
        hops = self._hops(b, p, c.data_parallel)
        queue = (m - 1) * (self._least_cut(b) * self._slowest(p, c.data_parallel)) \
            if p > 1 and m > 1 else 0.0
        return chain + hops + queue

    def bound_from_stash(self, c: Candidate, counts: list[int]) -> float:
        """Little's law: stage s holds at most counts[s] micro-batches, each for at least the
        round trip from its forward to its backward, so a step lasts >= m * trip / count."""
        plan = c.plan
        assert plan is not None
        net = self.links(c.stages, c.data_parallel)
        hop = [net.latency + nb / bw for nb, bw in zip(plan.send_bytes, net.bandwidths)]
        work = plan.sim_forward(self.recompute) + self._chain_backward(c)
        trip = np.cumsum((work + 2 * np.asarray([*hop, 0.0]))[::-1])[::-1]
        pipeline = float(np.max(c.num_micro_batches * trip / np.maximum(counts, 1)))
        return pipeline + self.allreduce(c)

    def _split_bound(self, c: Candidate) -> str | None:
        """The split-backward schedule ``c``'s bounds must hold for, if any: its own, or
        before a schedule="auto" search branches it, any it weighs."""
        names = [c.schedule] if c.schedule else self.schedules
        return next((n for n in names if is_split(n)), None)

    def _chain_backward(self, c: Candidate) -> np.ndarray:
        """Each stage's backward as far as the stage upstream waits for it: all of it, or in
        a split-backward schedule only the input-gradient part (``W`` can run later)."""
        plan = c.plan
        assert plan is not None
        split = self._split_bound(c)
        if split is None:
            return np.asarray(plan.backward, dtype=float)
        backward, weight = self.backward_costs(plan, split)
        return np.asarray(backward, dtype=float) - np.asarray(weight, dtype=float)

    def allreduce(self, c: Candidate) -> float:
        """Gradient all-reduce of the largest stage across replicas, plus summing the
        gradients of weights that several stages hold (tied embeddings)."""
        assert c.plan is not None
        net = self.links(c.stages, c.data_parallel)
        replicas = net.allreduce(float(c.plan.grads.max()), c.data_parallel)
        tied = net.allreduce(c.plan.shared_grads, 2) if c.stages > 1 else 0.0
        return replicas + tied

    def schedule_costs(self, c: Candidate, recompute: bool | Sequence[bool] | None = None,
                       schedule: str = "") -> ScheduleCosts:
        """The candidate's per-stage F, R, B and link times, which cost-aware schedules (Varuna's
        order, split backward's W placement) are generated from. ``recompute``: per-stage flags
        (default: the planner's one setting)."""
        rc = self.recompute if recompute is None else recompute
        plan = c.plan
        assert plan is not None
        net = self.links(c.stages, c.data_parallel)
        links = [net.latency + nb / bw for nb, bw in zip(plan.send_bytes, net.bandwidths)] \
            if c.stages > 1 else []
        backward, weight = self.backward_costs(plan, schedule or c.schedule)
        return ScheduleCosts.of(plan.sim_forward(rc), backward,
                                recompute=plan.recompute, links=links, weight_grad=weight)

    def backward_costs(self, plan: StagePlan,
                       schedule: str = "") -> tuple[list[float], list[float]]:
        """(backward, its weight-gradient part W) per stage, as the schedule runs them: for a
        split-backward schedule with a profile that timed the split, the input-gradient pass
        plus the weight pass (more than the fused backward), except on the first stage,
        which needs no input gradients and runs its fused backward as W."""
        fused = [float(b) for b in plan.backward]
        if not is_split(schedule or self.schedules[0]) or plan.input_grad is None or plan.weight_grad is None:
            return fused, weight_grads(fused)
        backward = [float(i + w) for i, w in zip(plan.input_grad, plan.weight_grad)]
        weight = [float(w) for w in plan.weight_grad]
        if len(fused) > 1:
            backward[0] = weight[0] = fused[0]
        else:
            backward, weight = fused, weight_grads(fused)
        return backward, weight

    def ordered(self, c: Candidate, effort: str = "full") -> Schedule:
        """The schedule generated from ``c``'s own stage and link times -- what ``price``
        will give the plan and the runtime will run -- so candidates are compared by the
        step they would really take (Varuna's order from unit costs can be slower or faster
        than the one the chosen partition gets). Orders that do not depend on costs (and any
        order of one stage) come from the cache. ``effort``: "quick" or "rough", a cheaper
        generator's order (its step is an upper bound of the full order's)."""
        name = c.schedule or self.schedules[0]
        if c.stages == 1 or not depends_on_costs(name):
            return self.built(c.stages, c.num_micro_batches, name)[0]  # compiled once
        return build_schedule(name, c.stages, c.num_micro_batches, self.recompute,
                              self.schedule_costs(c), effort=effort)

    def has_quick(self, c: Candidate) -> bool:
        """Whether ``c``'s order has cheaper estimates (``ordered(effort=...)``)."""
        return c.stages > 1 and has_quick(c.schedule or self.schedules[0])

    def finish(self, c: Candidate, effort: str = "full") -> float | None:
        """``c``'s step with the order generated from its own costs, or None when that order
        holds more micro-batches than fit. The search checked memory with the unit-cost
        order's stash counts; a cost-aware order may hold more (a split backward that defers
        its ``W`` into the bubbles: 27 instead of 9 on a GPT at P=8, m=32), so the stages
        are checked again with the order's own counts and, where they grew, partitioned once
        more for them, as ``configure.assign_and_price`` would. ``effort``: with a cheaper
        generator's order (see ``ordered``)."""
        c.estimated = c.stages > 1 and cheaper(c.schedule or self.schedules[0], effort)
        sched = self.ordered(c, effort)
        counts = peak_stash_counts(sched)
        if not self._fits(c, counts):
            checked = c.stash_counts or (1,) * c.stages
            grown = [max(a, b) for a, b in zip(counts, checked)]
            if not self.fit(c, grown):
                return None
            sched = self.ordered(c, effort)  # the new partition's own order
            if not self._fits(c, peak_stash_counts(sched)):
                return None
        return self.simulated(c, sched)

    def simulated(self, c: Candidate, sched: Schedule,
                  recompute: bool | Sequence[bool] | None = None) -> float:
        rc = self.recompute if recompute is None else recompute
        plan = c.plan
        assert plan is not None
        net = self.links(c.stages, c.data_parallel)
        backward, weight = self.backward_costs(plan, sched.name)
        # an order made for this candidate is timed once: no compiled simulation (the cached
        # cost-free ones, timed for many candidates, keep theirs); the same floats either way
        made = c.stages > 1 and depends_on_costs(sched.name)
        sim = (simulate_step if made else simulate)(
            sched, forward=plan.sim_forward(rc), backward=backward,
            recompute=plan.recompute, send_bytes=plan.send_bytes, latency=net.latency,
            bandwidth=net.bandwidths if c.stages > 1 else math.inf, weight_grad=weight,
        )
        c.allreduce_time = self.allreduce(c)
        c.bubble = sim.bubble_fraction
        c.step_time = sim.step_time + c.allreduce_time
        return c.step_time

    # -- the search ----------------------------------------------------------------------------

    def candidates(self, space: Space) -> list[Candidate]:
        most = self.table.num_units
        if space.stages is not None:
            if space.stages > most:
                raise PartitionError(
                    f"stages={space.stages} is more than the {most} places the model can be cut "
                    f"(operations of the model between cuts): use at most {most} stages"
                    f"{held_together(self.table.written_spans, len(self.table.names))}"
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
                sizes = [space.micro_batch_size] if space.micro_batch_size is not None \
                    else divisors(batch)
                found += [Candidate(p, d, b, batch // b) for b in sizes if batch % b == 0]
        return found

    def search(self, space: Space, top: int = 5, exact: int = 1) -> SearchResult:
        """The ``top`` fastest candidates, best first. The first ``exact`` are simulated with
        the order the full generator makes from their own costs (what the plan would run);
        the others may keep a cheaper generator's estimate (``Candidate.estimated``: an
        order at most as fast, so the row is no better than the plan would be).

        How the exact rows stay exact: a candidate is first simulated with the "quick"
        order, whose step e is at most QUICK_SLACK above the full order's, so it waits in
        the heap at max(its bound, e / (1 + QUICK_SLACK)), a lower bound of its full step;
        popped there while exact rows are missing, it gets the full order. Once they are
        found, what is left only fills the listed rows: the "quick" order's step (so that
        a row does not depend on whether it was popped before or after the exact ones),
        or the "rough" one's where the candidate's own partition is certainly slower than
        its key (``_suspect``: far down the list or off it)."""
        start = time.perf_counter()
        result = SearchResult(top=[])
        pool = self.candidates(space)
        result.considered = len(pool) * len(self.schedules)
        order = itertools.count()
        heap = [(self._key(bound, c), next(order), 0, c)
                for bound, c in zip(self.bounds_from_totals(pool), pool)]
        heapq.heapify(heap)

        def push(seconds: float, level: int, c: Candidate) -> None:
            c.bound = seconds
            heapq.heappush(heap, (self._key(seconds, c), next(order), level, c))

        while heap and len(result.top) < top:
            _, _, level, c = heapq.heappop(heap)
            if level == 4:  # simulated, and no other candidate can be faster
                result.top.append(c)
            elif level == 3:  # estimated: the full order, while the top needs exact rows
                if len(result.top) < exact and c.estimated:
                    step = self.finish(c)
                    if step is not None:
                        push(step, 4, c)
                else:
                    push(c.step_time, 4, c)
            elif level == 0:
                c.plan = self.partition(c.micro_batch_size, c.stages, c.stash_counts)
                result.partitioned += 1
                if c.plan is not None:
                    push(self.bound_from_stages(c), 1, c)
            elif level == 1:
                # "auto": one candidate per schedule from here (memory and the stash bound
                # depend on the schedule); a candidate re-partitioned for one keeps it
                for one in self._branches(c):
                    if one.stages > 1 and depends_on_costs(one.schedule):
                        # its order (and the micro-batches it holds) comes from its own costs:
                        # memory is checked with those counts when it is generated (finish);
                        # a unit-cost order made here just for its counts cost as much
                        push(self.bound_from_stages(one), 2, one)
                        continue
                    _, counts = self.built(one.stages, one.num_micro_batches, one.schedule)
                    if not self._fits(one, counts):
                        if not one.exact and self.fit(one, counts):  # re-partitioned
                            push(self.bound_from_stages(one), 1, one)
                        continue
                    push(max(self.bound_from_stages(one), self.bound_from_stash(one, counts)),
                         2, one)
            else:  # level 2: simulated, with a cheaper order first where there is one
                result.simulated += 1
                bound = c.bound
                if not self.has_quick(c):
                    step = self.finish(c)
                    if step is not None:
                        push(step, 4, c)
                elif len(result.top) < exact:  # may be among the exact rows: bounded estimate
                    step = self.finish(c, "quick")
                    if step is not None and c.estimated:
                        push(max(bound, step / (1 + QUICK_SLACK)), 3, c)
                    elif step is not None:  # (the quick order is the full one)
                        push(step, 4, c)
                else:  # only listed: the quick estimate is its row, or the rough one
                    # where its own partition cannot be fast (see ``_suspect``)
                    step = self.finish(c, "rough" if self._suspect(c, bound) else "quick")
                    if step is not None:
                        push(step, 4, c)
        result.seconds = time.perf_counter() - start
        result.alternatives = [c.alternative(i == 0) for i, c in enumerate(result.top)]
        return result

    def _suspect(self, c: Candidate, bound: float) -> bool:
        """Whether ``c``'s step is above ``bound`` for certain if its partition is not made
        again for an order's stash counts (its own cuts queue on a slow link, see
        ``_plan_queue``): its row then gets the rough estimate, as it will be far down the
        list or off it (72 MiB crossing 1 Gbit/s per micro-batch: the quick orders of such
        deep pipelines were most of a memory-tight search on a slow link)."""
        return self._key(self.bound_from_stages(c, final=True), c) > self._key(bound, c)

    def best_schedule(self, c: Candidate) -> str:
        """The schedule ``c`` (P, D, b, m; given, not searched) runs fastest with, among those
        that fit (partitioned as the search would); the first weighed when none does."""
        if len(self.schedules) == 1:
            return self.schedules[0]
        c.plan = self.partition(c.micro_batch_size, c.stages, None)
        if c.plan is None:
            return self.schedules[0]
        timed = []
        for one in self._branches(c):
            _, counts = self.built(one.stages, one.num_micro_batches, one.schedule)
            if self._fits(one, counts) or self.fit(one, counts):
                timed.append((self._key(self.simulated(one, self.ordered(one)), one),
                              one.schedule))
        return min(timed)[1] if timed else self.schedules[0]

    def _branches(self, c: Candidate) -> list[Candidate]:
        """``c`` for each schedule the planner weighs (``c`` itself once it has one)."""
        if c.schedule:
            return [c]
        # one stage runs its micro-batches in order under any schedule: weighing them all
        # only listed the same configuration once per name
        if len(self.schedules) == 1 or c.stages == 1:
            c.schedule = self.schedules[0]
            return [c]
        return [dataclasses.replace(c, schedule=name) for name in self.schedules]

    def _key(self, seconds: float, c: Candidate) -> tuple[float, int, int, int, int]:
        """Time per sample; ties go to fewer devices, fewer stages, bigger micro-batches,
        then the schedule listed first (plain before split backward)."""
        per_sample = float(f"{seconds / c.samples:.9g}")
        rank = self._rank.get(c.schedule, 0)
        return (per_sample, c.stages * c.data_parallel, c.stages, -c.micro_batch_size, rank)

    def _fits(self, c: Candidate, counts: Sequence[int], cap: float | None = None) -> bool:
        assert c.plan is not None
        memory = c.plan.memory(counts, self.recompute)
        c.memory = tuple(float(m) for m in memory)
        return bool(np.all(memory <= (self.memory_cap if cap is None else cap)))

    def fit(self, c: Candidate, counts: Sequence[int], cap: float | None = None) -> bool:
        """Partition ``c`` for the schedule's real stash counts (the first partition assumed
        one micro-batch per stage), so that every stage fits by the memory model."""
        cap = self.memory_cap if cap is None else cap
        c.exact, c.stash_counts = True, tuple(counts)
        c.plan = self.partition(c.micro_batch_size, c.stages, c.stash_counts, cap)
        return c.plan is not None and self._fits(c, counts, cap)
