"""Pricing a candidate: its partition (memoized per (b, P, stash counts, budget)), the order its
schedule runs in, the memory check with that order's stash counts, and the simulated step plus
the data-parallel and tied all-reduces.

A ``Pricer`` is one model on one cluster under one setting (cost table, cluster, network,
memory cap, the schedules weighed, recompute, optimizer sharding, stages per rank), fixed when
it is made: nothing outside writes it, and a different setting is a different pricer
(``Pricer.per_rank``). What it works out is kept in its ``Memo``, each entry a pure function of
the pricer and the entry's key, so a memo never needs to be invalidated. The search
(``search.py``) holds a pricer; the lower bounds of a step (``floors.py``) are functions of a
pricer and a candidate.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..costs.memory import sharded_held
from ..costs.roofline import DeviceSpec
from ..costs.wire import LOSSIER_MARGIN, ReplicaSync
from ..schedule import (
    Schedule,
    ScheduleCosts,
    ScheduleSpec,
    build_schedule,
    peak_stash_counts,
    schedule_spec,
    simulate,
    simulate_step,
    split_base,
    weighed_schedules,
)
from ..schedule.varuna import QUICK_VARIANTS, ROUGH_VARIANTS, overflows, stash_floor
from ..world.network import NetworkProfile
from .balance import Balancer, PartitionCosts
from .candidates import Candidate, weight_grads
from .cluster import Cluster
from .cost_table import CostTable, UnitArrays
from .network import Links, links, rank_allreduce, rank_links
from .slow_links import (
    boundary_modes,
    codec_per_stage,
    compressed,
    partition_bandwidths,
    stage_syncs,
    sync_seconds,
)


@dataclass
class Memo:
    """What one ``Pricer`` has worked out, by key. Every value depends only on the pricer's
    fields and its key (a budget or a shard count that varies is part of the key)."""

    # (b, shards) -> the partitioner at micro-batch size b
    balancers: dict[tuple[int, int], Balancer] = field(default_factory=dict)
    # (b, P, stash counts, budget, shards, per-boundary bandwidths) -> the fastest fitting
    # partition, or None
    plans: dict[tuple, PartitionCosts | None] = field(default_factory=dict)
    # (schedule, P, m) -> the unit-cost schedule and its per-stage stash counts
    schedules: dict[tuple[str, int, int], tuple[Schedule, list[int]]] = \
        field(default_factory=dict)
    # (P, D) -> the links of that placement
    links: dict[tuple[int, int], Links] = field(default_factory=dict)
    # for ``floors.py``: (b, split) -> the model's totals at b; (b, P, D) -> one round trip's hops
    totals: dict[tuple[int, bool], tuple[float, ...]] = field(default_factory=dict)
    hops: dict[tuple[int, int, int], float] = field(default_factory=dict)
    # (the candidate as ``finish`` reads it, effort) -> its step and the candidate after it:
    # the orders made for the finalists, most of a search of a big model
    finished: dict[tuple, tuple[float | None, Candidate]] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class Pricer:
    """One model on one cluster: partitions, orders and simulated steps of candidates, each
    memoized (the search in ``search.py`` and the floors in ``floors.py`` build on it). Make
    one with ``Pricer.build``."""

    table: CostTable
    cluster: Cluster
    spec: DeviceSpec  # what time estimates are made for
    network: NetworkProfile | None  # measured links (None: the cluster's stated ones)
    # the schedules weighed (their registry entries; several for schedule="auto")
    schedules: tuple[ScheduleSpec, ...]
    recompute: bool
    memory_cap: float  # bytes one stage may hold (a rank's memory over its v stages)
    # v of a virtual schedule (several stages per rank; None: its default)
    stages_per_rank: int | None = None
    # optimizer state over the D replicas (ZeRO-1): True counts it sharded wherever D > 1,
    # "auto" only for a candidate that does not fit otherwise, False never
    shard_optimizer: bool | str = False
    # what slow links carry (``slow_links.py``): compile's compression= and replica_sync=
    compression: str = "off"
    replica_sync: ReplicaSync = "exact"
    memo: Memo = field(default_factory=Memo, init=False, repr=False)

    @classmethod
    def build(cls, table: CostTable, cluster: Cluster, *, schedule: str | ScheduleSpec,
              recompute: bool,
              spec: DeviceSpec | None = None, network: NetworkProfile | None = None,
              shard_optimizer: bool | str = False,
              stages_per_rank: int | None = None, compression: str = "off",
              replica_sync: ReplicaSync = "exact") -> Pricer:
        """``schedule``: an entry or its name, or "auto" (each candidate weighs them all:
        ``schedule.weighed_schedules``). A rank running ``stages_per_rank`` stages checks
        each against that share of its memory."""
        return cls(table, cluster, spec or cluster.spec, network,
                   weighed_schedules(schedule), recompute,
                   float(cluster.gpu_memory) / (stages_per_rank or 1), stages_per_rank,
                   shard_optimizer, compression, replica_sync)

    def per_rank(self, v: int) -> Pricer:
        """This setting with ``v`` stages per rank (each stage checked at 1/v of the device
        memory), with a memo of its own; itself where that is its setting already."""
        cap = float(self.cluster.gpu_memory) / v
        if v == self.stages_per_rank and cap == self.memory_cap:
            return self
        return dataclasses.replace(self, stages_per_rank=v, memory_cap=cap)

    # -- memoized --------------------------------------------------------------------------------

    def balancer(self, b: int, shards: int = 1) -> Balancer:
        """Partitions at micro-batch size ``b``, the optimizer state split over ``shards``."""
        if (b, shards) not in self.memo.balancers:
            bw = links(self.cluster, 2, 1, self.network).partition_bandwidth
            units = self.table.unit_arrays(b, self.spec)
            self.memo.balancers[b, shards] = self._make_balancer(units, bw, shards)
        return self.memo.balancers[b, shards]

    def balancer_for(self, units: UnitArrays, stages: int, shards: int = 1) -> Balancer:
        """A balancer over given unit arrays (one unit per stage of a made partition)."""
        return self._make_balancer(units, self.links(stages, 1).partition_bandwidth, shards)

    def _make_balancer(self, units: UnitArrays, bandwidth: float, shards: int) -> Balancer:
        shared = self.table.shared
        if shards > 1:  # ZeRO-1: each replica holds 1/shards of the optimizer state
            units = dataclasses.replace(
                units, weights=sharded_held(units.weights, units.grads, shards))
            shared = tuple(s.sharded(shards) for s in shared)
        return Balancer(units, shared, bandwidth, self.recompute)

    def partition(self, b: int, stages: int, stash_counts: int | tuple[int, ...] | None,
                  budget: float | None = None, shards: int = 1,
                  bandwidths: tuple[float, ...] | None = None) -> PartitionCosts | None:
        """Fastest partition whose stages fit ``budget`` (default: the device memory) by the
        memory model, each stage holding its ``stash_counts`` micro-batches (one count for
        all, or per stage; None: one), the optimizer state split over ``shards`` replicas.
        ``bandwidths``: per boundary, the link each stage's send is priced at (None: one)."""
        budget = self.memory_cap if budget is None else budget
        counts = (stash_counts or 1,) * stages if not isinstance(stash_counts, tuple) \
            else stash_counts
        key = (b, stages, counts, budget, shards, bandwidths)
        if key not in self.memo.plans:
            self.memo.plans[key] = self.balancer(b, shards).partition(stages, budget, counts,
                                                                      bandwidths)
        return self.memo.plans[key]

    def link_bandwidths(self, c: Candidate) -> tuple[float, ...] | None:
        """Per boundary, what the partition prices ``c``'s cuts at: each link's bandwidth
        (widened by an explicit compression), where the links of ``c``'s placement differ
        from the balancer's one bandwidth or are compressed; None: that one bandwidth."""
        if c.stages < 2 or (self.stages_per_rank or 1) > 1:
            return None
        widths = partition_bandwidths(self.links(c.stages, c.data_parallel), self.compression)
        one = self.balancer(c.micro_batch_size).bandwidth
        return None if all(w == one for w in widths) else tuple(widths)

    def plan_candidate(self, c: Candidate, stash_counts: int | tuple[int, ...] | None = None,
                       budget: float | None = None) -> PartitionCosts | None:
        """``c``'s partition (as :meth:`partition`), with its optimizer state sharded over its
        D replicas where the setting says: always for True, and for "auto" only when no
        partition fits without (``c.shard`` records which)."""
        d = c.data_parallel
        shards = d if self.shard_optimizer is True and d > 1 else 1
        bws = self.link_bandwidths(c)
        plan = self.partition(c.micro_batch_size, c.stages, stash_counts, budget, shards, bws)
        if plan is None and self.shard_optimizer == "auto" and d > 1:
            plan = self.partition(c.micro_batch_size, c.stages, stash_counts, budget, d, bws)
            shards = d
        c.shard = plan is not None and shards > 1
        return plan

    def kind(self, schedule: str | ScheduleSpec = "") -> ScheduleSpec:
        """The registry entry of ``schedule`` (a candidate's schedule name; default: the
        first the pricer weighs)."""
        return schedule_spec(schedule) if schedule else self.schedules[0]

    def built(self, stages: int, micro_batches: int,
              schedule: str | ScheduleSpec = "") -> tuple[Schedule, list[int]]:
        """The schedule (its compiled form is cached on it) and its per-stage stash counts,
        from unit costs. ``schedule``: an entry or its name (default: the first weighed)."""
        kind = self.kind(schedule)
        key = (kind.name, stages, micro_batches)
        if key not in self.memo.schedules:
            sched = build_schedule(kind, stages, micro_batches, self.recompute,
                                   stages_per_rank=self.stages_per_rank if kind.virtual
                                   else None)
            self.memo.schedules[key] = (sched, peak_stash_counts(sched))
        return self.memo.schedules[key]

    def links(self, stages: int, replicas: int) -> Links:
        key = (stages, replicas)
        if key not in self.memo.links:
            self.memo.links[key] = links(self.cluster, stages, replicas, self.network)
        return self.memo.links[key]

    def allreduce(self, c: Candidate) -> float:
        """The replicas' sync of the slowest stage (each stage's under its ``replica_sync``,
        noted on ``c.sync``), plus summing the gradients of weights that several stages
        hold (tied embeddings)."""
        assert c.plan is not None
        net = self.links(c.stages, c.data_parallel)
        grads = [float(g) for g in c.plan.grads]
        c.sync = self.syncs(c, grads, net)
        sharded = self.sharded(c)
        shapes = self.table.parameter_shapes
        replicas = max(sync_seconds(s, g, net, c.data_parallel, self.spec, shapes, sharded)
                       for s, g in zip(c.sync, grads))
        tied = net.allreduce(c.plan.shared_grads, 2) if c.stages > 1 else 0.0
        return replicas + tied

    def syncs(self, c: Candidate, grads: Sequence[float], net: Links) -> tuple:
        """Per stage, its replica sync (``slow_links.stage_syncs``)."""
        return stage_syncs(self.replica_sync, grads, net, c.data_parallel, self.spec,
                           self.table.parameter_shapes, self.sharded(c))

    def sharded(self, c: Candidate) -> bool:
        """Whether ``c``'s optimizer state is sharded (ZeRO-1: its step all-gathers the
        parameters, half an all-reduce's bytes more): with ``shard_optimizer=True``, or where
        memory needs it. (Where "auto" shards only because ``pipe.optimizer`` does by
        default, on a fast link, the price leaves the all-gather out.)"""
        return c.data_parallel > 1 and (self.shard_optimizer is True or c.shard)

    def modes(self, c: Candidate, net: Links | None = None) -> tuple[str, ...]:
        """Per boundary of ``c``, how it travels (``slow_links.boundary_modes``)."""
        assert c.plan is not None
        net = net or self.links(c.stages, c.data_parallel)
        return boundary_modes(self.compression, net, [float(b) for b in c.plan.send_bytes],
                              self.spec)

    def schedule_costs(self, c: Candidate, recompute: bool | Sequence[bool] | None = None,
                       schedule: ScheduleSpec | None = None) -> ScheduleCosts:
        """The candidate's per-stage F, R, B and link times, which cost-aware schedules (Varuna's
        order, split backward's W placement) are generated from. ``recompute``: per-stage flags
        (default: the pricer's one setting). Compressed boundaries send their wire bytes and
        add their (de)quantisation to both stages they join."""
        rc = self.recompute if recompute is None else recompute
        plan = c.plan
        assert plan is not None
        net = self.links(c.stages, c.data_parallel)
        modes = self.modes(c, net) if c.stages > 1 else ()
        sent = compressed(plan.send_bytes, modes)
        links = [net.latency + nb / bw for nb, bw in zip(sent, net.bandwidths)] \
            if c.stages > 1 else []
        backward, weight = self.backward_costs(plan, schedule or self.kind(c.schedule))
        forward = plan.sim_forward(rc)
        if any(m != "off" for m in modes):
            extra = codec_per_stage(plan.send_bytes, modes, self.spec)
            forward = forward + extra
            backward = [b + e for b, e in zip(backward, extra)]
        return ScheduleCosts.of(forward, backward,
                                recompute=plan.recompute, links=links, weight_grad=weight)

    def backward_costs(self, plan: PartitionCosts,
                       schedule: ScheduleSpec | None = None) -> tuple[list[float], list[float]]:
        """(backward, its weight-gradient part W) per stage, as the schedule runs them: for a
        split-backward schedule with a profile that timed the split, the input-gradient pass
        plus the weight pass (more than the fused backward), except on the first stage,
        which needs no input gradients and runs its fused backward as W."""
        fused = [float(b) for b in plan.backward]
        if not (schedule or self.schedules[0]).split_backward or plan.input_grad is None or plan.weight_grad is None:
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
        order of one stage) come from the memo. ``effort``: "quick" or "rough", a cheaper
        generator's order (its step is an upper bound of the full order's)."""
        kind = self.kind(c.schedule)
        if c.stages == 1 or not kind.cost_aware:
            return self.built(c.stages, c.num_micro_batches, kind)[0]  # compiled once
        return build_schedule(kind, c.stages, c.num_micro_batches, self.recompute,
                              self.schedule_costs(c), effort=effort)

    def has_quick(self, c: Candidate) -> bool:
        """Whether ``c``'s order has cheaper estimates (``ordered(effort=...)``)."""
        return c.stages > 1 and self.kind(c.schedule).has_quick

    def finish(self, c: Candidate, effort: str = "full") -> float | None:
        """``_finish`` (below), remembered: a candidate seen before (in this search, or in
        another world's search sharing the memo: ``cache.shared_memo``) takes its step and
        what finishing set on it from the memo."""
        key = (c.stages, c.data_parallel, c.micro_batch_size, c.num_micro_batches, c.schedule,
               c.shard, c.exact, c.stash_counts,
               None if c.plan is None else tuple(c.plan.bounds), effort)
        if key not in self.memo.finished:
            step = self._finish(c, effort)
            self.memo.finished[key] = (step, dataclasses.replace(c))
            return step
        step, after = self.memo.finished[key]
        for f in dataclasses.fields(Candidate):
            if f.name != "floor":  # (the search's own: the key it was last pushed with)
                setattr(c, f.name, getattr(after, f.name))
        return step

    def _finish(self, c: Candidate, effort: str = "full") -> float | None:
        """``c``'s step with the order generated from its own costs, or None when that order
        holds more micro-batches than fit. The search checked memory with the unit-cost
        order's stash counts; a cost-aware order may hold more (a split backward that defers
        its ``W`` into the bubbles: 27 instead of 9 on a GPT at P=8, m=32), so the stages
        are checked again with the order's own counts and, where they grew, partitioned once
        more for them, as ``configure.assign_and_price`` would. ``effort``: with a cheaper
        generator's order (see ``ordered``)."""
        c.estimated = c.stages > 1 and self.kind(c.schedule).cheaper(effort)
        if self._cannot_fit(c):
            return None  # what the order's own counts would find, without making the order
        sched = self.ordered(c, effort)
        counts = peak_stash_counts(sched)
        if not self.fits(c, counts):
            checked = c.stash_counts or (1,) * c.stages
            grown = [max(a, b) for a, b in zip(counts, checked)]
            if not self.fit(c, grown):
                return None
            if self._overflows(c, effort):
                return None  # as below, from orders given up as soon as a stage overflows
            sched = self.ordered(c, effort)  # the new partition's own order
            counts = peak_stash_counts(sched)
            if not self.fits(c, counts):
                return None
        c.run_counts = tuple(counts)  # what its memory was checked with: compile starts there
        return self.simulated(c, sched)

    def _cannot_fit(self, c: Candidate) -> bool:
        """Whether ``finish`` would certainly return None: with counts no larger than any
        order of ``c``'s schedule holds (``stash_floor``), neither the candidate's partition
        nor any other fits (memory grows with the counts). Most deep candidates of a big
        model end so: at 24 Llama-70B layers on 64 devices, 123 of 132 Varuna candidates (the
        orders were 90% of planning); at 40 layers, 284 of the 296 orders made were split
        backward's that did not fit, before it had a floor too."""
        floor = self.stash_floor(c)
        if floor is None:
            return False
        assert c.plan is not None
        if bool(np.all(c.plan.memory(floor, self.recompute) <= self.memory_cap)):
            return False
        checked = c.stash_counts or (1,) * c.stages
        grown = tuple(max(a, b) for a, b in zip(floor, checked))
        return self.partition(c.micro_batch_size, c.stages, grown) is None

    def stash_floor(self, c: Candidate) -> tuple[int, ...] | None:
        """Per stage, micro-batches every order ``ordered(c, ...)`` may make holds at least
        at its peak (``order_stash_floor``); None where none is derived."""
        kind = self.kind(c.schedule)
        if c.stages < 2 or c.plan is None or not kind.cost_aware:
            return None
        p, m = c.stages, c.num_micro_batches
        rc = [bool(self.recompute) and s < p - 1 for s in range(p)]
        return order_stash_floor(kind, p, m, rc, self.schedule_costs(c),
                                 lambda base: self.built(p, m, base)[1])

    def _overflows(self, c: Candidate, effort: str) -> bool:
        """Whether the order ``ordered(c, effort)`` would make holds more micro-batches on some
        stage than fit there (so ``finish`` returns None), found without making it in full:
        a Varuna order is given up at the first forward a stage cannot hold."""
        if c.stages < 2 or not self.kind(c.schedule).varuna_stash or c.plan is None:
            return False
        plan, m = c.plan, c.num_micro_batches
        lo, hi = np.zeros(c.stages), np.full(c.stages, float(m + 1))  # fits / does not
        while np.any(hi - lo > 1):  # each stage's memory grows with its own count
            mid = np.floor((lo + hi) / 2)
            fits = plan.memory(mid, self.recompute) <= self.memory_cap
            lo, hi = np.where(fits, mid, lo), np.where(fits, hi, mid)
        variants = {"quick": QUICK_VARIANTS, "rough": ROUGH_VARIANTS}.get(effort)
        rc = [bool(self.recompute)] * c.stages
        return overflows(c.stages, m, rc, self.schedule_costs(c), variants,
                         [int(k) for k in lo])

    def simulated(self, c: Candidate, sched: Schedule,
                  recompute: bool | Sequence[bool] | None = None) -> float:
        """``c``'s step with ``sched`` plus its all-reduces (noted on ``c``: ``step_time``,
        ``allreduce_time``, ``bubble``). ``recompute``: per-stage flags (default: the
        pricer's one setting)."""
        rc = self.recompute if recompute is None else recompute
        plan = c.plan
        assert plan is not None
        net = self.links(c.stages, c.data_parallel)
        if sched.is_virtual:  # stages on fewer ranks: links and reductions per rank
            net = rank_links(self.links(sched.num_ranks, c.data_parallel), sched)
        backward, weight = self.backward_costs(plan, sched.spec)
        # an order made for this candidate is timed once: no compiled simulation (the cached
        # cost-free ones, timed for many candidates, keep theirs); the same floats either way
        made = c.stages > 1 and sched.spec.cost_aware

        def run(modes: tuple[str, ...]) -> object:
            forward, back = plan.sim_forward(rc), backward
            if any(m != "off" for m in modes):  # wire bytes, and the codec on both sides
                extra = codec_per_stage(plan.send_bytes, modes, self.spec)
                forward, back = forward + extra, [b + e for b, e in zip(backward, extra)]
            return (simulate_step if made else simulate)(
                sched, forward=forward, backward=back,
                recompute=plan.recompute, send_bytes=compressed(plan.send_bytes, modes)
                if modes else plan.send_bytes, latency=net.latency,
                bandwidth=net.bandwidths if c.stages > 1 else math.inf, weight_grad=weight,
            )

        modes = self.modes(c, net) if c.stages > 1 else ()
        sim = run(modes)
        if self.compression == "auto" and any(m != "off" for m in modes):
            exact_modes = ("off",) * len(modes)
            exact = run(exact_modes)  # the simulator's word: compress only where it pays,
            # by more than the margin a lossy choice must earn (costs/wire.py)
            if sim.step_time >= exact.step_time * (1 - LOSSIER_MARGIN):  # type: ignore[attr-defined]
                sim, modes = exact, exact_modes
        c.compression = tuple(modes)
        if sched.is_virtual:
            c.allreduce_time = self.virtual_sync(c, net, sched)
        else:
            c.allreduce_time = self.allreduce(c)
        c.bubble = sim.bubble_fraction  # type: ignore[attr-defined]
        # plus what a step spends outside its actions (learned.py): the same for every
        # candidate of this world, so it moves predictions, not which one is fastest
        c.step_time = sim.step_time + c.allreduce_time + self.step_overhead  # type: ignore[attr-defined]
        return c.step_time

    @property
    def step_overhead(self) -> float:
        """Seconds a step spends outside its actions (``learned.py``), where measured costs
        price it; 0 on the datasheet's roofline."""
        measured = self.table.measured
        return float(measured.step) if measured is not None else 0.0

    def virtual_sync(self, c: Candidate, net: Links, sched: Schedule) -> float:
        """The reductions of a virtual schedule (per rank: ``network.rank_allreduce``), under
        one replica sync for every rank (its ratio of the bytes, where not exact)."""
        assert c.plan is not None
        base = rank_allreduce(net, c.plan, sched, c.data_parallel)
        grads = [float(g) for g in c.plan.grads]
        c.sync = self.syncs(c, grads, self.links(c.stages, c.data_parallel))
        if all(s == "exact" for s in c.sync):
            return base
        exact = max(sync_seconds("exact", g, net, c.data_parallel, self.spec) for g in grads)
        ours = max(sync_seconds(s, g, net, c.data_parallel, self.spec,
                                self.table.parameter_shapes) for s, g in zip(c.sync, grads))
        return base * (ours / exact) if exact > 0 else base

    def fits(self, c: Candidate, counts: Sequence[int], cap: float | None = None) -> bool:
        """Whether ``c``'s partition fits ``cap`` (default: the memory cap) holding ``counts``
        micro-batches per stage; its memory at those counts is noted on ``c``."""
        assert c.plan is not None
        memory = c.plan.memory(counts, self.recompute)
        c.memory = tuple(float(m) for m in memory)
        return bool(np.all(memory <= (self.memory_cap if cap is None else cap)))

    def fit(self, c: Candidate, counts: Sequence[int], cap: float | None = None) -> bool:
        """Partition ``c`` for the schedule's real stash counts (the first partition assumed
        one micro-batch per stage), so that every stage fits by the memory model."""
        cap = self.memory_cap if cap is None else cap
        c.exact, c.stash_counts = True, tuple(counts)
        c.plan = self.plan_candidate(c, c.stash_counts, cap)
        if c.plan is not None and not self.fits(c, counts, cap) and not c.shard and \
                self.shard_optimizer == "auto" and c.data_parallel > 1:
            # fits at these counts only with the optimizer state sharded
            c.plan = self.partition(c.micro_batch_size, c.stages, c.stash_counts, cap,
                                    c.data_parallel, self.link_bandwidths(c))
            c.shard = c.plan is not None
        return c.plan is not None and self.fits(c, counts, cap)


def order_stash_floor(kind: ScheduleSpec, p: int, m: int, rc: Sequence[bool],
                      costs: ScheduleCosts,
                      base_counts: Callable[[ScheduleSpec], Sequence[int]] | None = None
                      ) -> tuple[int, ...] | None:
    """Per stage, micro-batches every order of ``kind`` made from ``costs`` (any effort)
    holds at least at its peak; None where none is derived. Varuna's: ``varuna.stash_floor``.
    A split backward keeps its base order's F, R and B and holds each micro-batch until its
    ``W``, which comes after its ``B``: at least as long as the base holds it, so its counts
    are at least the base order's (a cost-free base: its own counts, ``base_counts`` or made
    here; Varuna's, made from the whole backward and from its input-gradient part: the
    smaller of the two floors)."""
    if kind.varuna_stash:
        return stash_floor(p, m, rc, costs)
    if not kind.places_weights:
        return None
    base = split_base(kind)
    if not base.order_reads_costs:
        if base_counts is not None:
            return tuple(base_counts(base))
        return tuple(peak_stash_counts(build_schedule(base, p, m, list(rc))))
    if not base.varuna_stash:
        return None
    whole, part = (stash_floor(p, m, rc, x) for x in (costs, costs.input_grad_only()))
    if whole is None or part is None:
        return None
    return tuple(min(a, b) for a, b in zip(whole, part))
