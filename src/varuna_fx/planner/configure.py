"""Choosing P, D and the micro-batch size, and pricing the partition the compiler made.

Given values are respected; the planner (``varuna_fx.planner.search``) chooses the missing ones
by simulating every candidate with measured (profile) or FLOP-estimated costs. In a running
distributed job P x D must use exactly its ranks. Two cases have nothing to search and keep the
given P with about four micro-batches per stage: a single device asked to run an explicit
number of stages (a notebook, a test: the stages share the device), and explicit values that
cannot match the running ranks (the runtime then says what to launch instead).

Layer: above ``planner`` and ``schedule``, below ``api``; imports nothing from the runtime
(``world/where.py`` answers whether this is a distributed run).

Pricing (``price``) simulates the made partition with the search's own pricer
(``pricing.Pricer``, set for the chosen layout: its ``cost_table`` unit arrays and
``balance.PartitionCosts``) and prices its memory with the one memory model, so the plan table's
memory column, the chosen alternatives row and ``Partition.stage_memory`` are the same
numbers. On the registry models ``assign_and_price`` always reached its fixed point after one
or two rounds. The search checks memory with its own schedule's counts, so a plan the planner
thought fitted can still be re-cut (or refused) by the partition pass.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch.fx as fx

from ..costs.roofline import DeviceSpec, NodeTimes
from ..errors import PartitionError, PlanError
from ..passes.assign_stages import CostSetting, compute_nodes, partition_problem, record_stages
from ..passes.partition import Partition, PartitionProblem, evaluate, partition
from ..schedule import (
    AUTO,
    Schedule,
    ScheduleChoice,
    ScheduleSpec,
    build_schedule,
    peak_stash_counts,
)
from ..world.where import running_world
from . import cache as plan_cache
from . import partition_cache
from .candidates import Candidate, Space
from .cluster import Cluster
from .compiled_speed import (
    CompileDecision,
    CompiledSpeed,
    CompiledTimes,
    decide,
    eager_seconds_per_sample,
    priced_here,
)
from .cost_table import CostTable
from .explain import explain_nothing_fits
from .machine import planning_times
from .options import PlanOptions
from .plan import Alternative
from .pricing import Pricer
from .profile import Profile, graph_hash
from .search import Planner
from .slow_links import byte_ratio, check_settings, shards_by_default
from .steady import TIE_TOLERANCE
from .virtual import weigh as weigh_virtual


@dataclass
class Configuration:
    stages: int
    data_parallel: int
    micro_batch_size: int
    num_micro_batches: int
    pipeline_bandwidth: float
    allreduce_bandwidth: float
    stash_counts: tuple[int, ...]  # the schedule's micro-batches held at once, per stage
    schedule: Schedule  # the one object simulated, and later run by the runtime
    pricer: Pricer  # the search's, for the chosen layout (v stages per rank): ``price`` uses it
    alternatives: list[Alternative] = field(default_factory=list)
    device: DeviceSpec | None = None  # what time estimates are made for
    node_times: NodeTimes | None = None  # measured costs, when a profile applies
    shard_optimizer: bool = False  # memory counted with optimizer state split over D (ZeRO-1)
    # the search's own partition of the chosen row (node positions): what its step was priced
    # with, so the compiled partition is never slower than the row (None: nothing searched)
    searched_bounds: tuple[int, ...] | None = None
    # per boundary, the bandwidth the partition prices its cut at (slow_links.py; None: the
    # one pipeline_bandwidth), and the share of gradient bytes the replica sync sends (what
    # the partition weighs each stage's all-reduce by)
    link_bandwidths: tuple[float, ...] | None = None
    sync_ratio: float = 1.0
    shards_by_default: bool = True  # Plan.shards_by_default
    # the plan cache's key of the search that chose this (None: nothing searched): the
    # partition pass's answer is kept under a key made from it (partition_cache.py)
    search_key: str | None = None
    # whether the stages run compiled, the factor they were priced with and why
    # (compiled_speed.decide; None: compile_stages not resolved here)
    compile: CompileDecision | None = None


@dataclass(frozen=True)
class Priced:
    """The partition the compiler made, priced by the planner's model (the one that weighed
    the alternatives), so the plan table and its alternatives row agree."""

    step_time: float
    stage_memory: tuple[float, ...]
    alternatives: tuple[Alternative, ...]
    schedule: Schedule  # generated from this partition's costs: what the runtimes run
    stash_counts: tuple[int, ...]  # that schedule's micro-batches held at once, per stage
    compression: tuple[str, ...] = ()  # per boundary, as simulated (slow_links.py)
    replica_sync: tuple = ()  # per stage, as priced
    # what the step is made of (``cost_terms``) and each stage's busy seconds per micro-batch
    terms: tuple[tuple[str, float], ...] = ()
    busy: tuple[float, ...] = ()
    spread: float | None = None  # the profile's relative spread (None: not measured)
    priced_here: bool = False  # by this machine's measured costs (profile or machine.py)
    learn_key: str | None = None  # where its step overhead is learned (learned.py)


def replica_batch(example_batch: int, global_batch_size: int | None, data_parallel: int) -> int:
    if global_batch_size is None:
        return example_batch
    if global_batch_size % data_parallel:
        raise PlanError(
            f"global_batch_size={global_batch_size} is not divisible by the {data_parallel} "
            "data-parallel replicas; choose a multiple"
        )
    return global_batch_size // data_parallel


def default_micro_batch_size(batch: int, stages: int) -> int:
    """Enough micro-batches to keep the bubble small (about 4 per stage), dividing the batch."""
    want = min(batch, 4 * stages)
    for count in range(want, batch + 1):
        if batch % count == 0:
            return batch // count
    return 1


def choose_configuration(gm: fx.GraphModule, options: PlanOptions, *, example_batch: int,
                         recompute: bool, profile: Profile | None = None,
                         table: CostTable | None = None,
                         compiled: CompiledSpeed | None = None) -> Configuration:
    """The configuration for ``options`` (its ``cluster`` given): what it fixes is kept, the
    rest chosen. ``options.schedule``: a name (resolved into its entry), or "auto" (the planner picks the fastest that
    fits, per candidate). ``options.stages_per_rank``: v, stages each rank runs (a virtual
    schedule: ``interleaved-1f1b``, ``zbv``, ``dualpipev``); None: that schedule's default.
    ``options.shard_optimizer``: True counts the optimizer state split over D wherever D > 1;
    "auto" only where a candidate does not fit otherwise; False never. ``recompute``: the
    setting planned for (compile decides it for ``options.recompute="auto"``). ``profile``:
    measured costs (``varuna_fx.planner.Profile``), or None for estimates. ``compiled``: the
    compiled stages' measured speed (``compiled_speed.resolve_speed``): where the stages run
    compiled (``options.compile_stages``, resolved by ``compiled_speed.decide``) they are
    priced with it."""
    assert options.cluster is not None, "the caller resolves Cluster.local()"
    # the schedule's entry (or "auto"), resolved once when the options were made
    cluster, schedule = options.cluster, options.schedule_choice
    stages_per_rank = options.stages_per_rank
    global_batch_size, micro_batch_size = options.global_batch_size, options.micro_batch_size
    stages, data_parallel = options.stages, options.data_parallel
    v = check_stages_per_rank(schedule, stages_per_rank)
    if stages is not None:  # before any schedule is built: 10**6 stages would take minutes
        operations = len(compute_nodes(gm))
        if stages > operations:
            raise PartitionError(f"stages={stages} is more than the {operations} operations of "
                                 f"the model: use at most {operations} stages")
    # a rank holds v stages, each checked at its share of the memory
    planner, decision = _planner(gm, cluster, schedule, recompute, profile, options, v, table,
                                 compiled, example_batch)
    pricer = planner.pricer
    alternatives: list[Alternative] = []
    searched: tuple[int, ...] | None = None
    world = running_world()
    run_counts: tuple[int, ...] | None = None  # the stash counts the search checked (below)
    sync: tuple = ()  # the pick's replica sync per stage, as the search priced it
    key: str | None = None  # the search's key in the plan cache (None: nothing searched)
    if v > 1:  # virtual stages: P given (or v per rank), D from the ranks
        ranks = (world or cluster.gpus) // (data_parallel or 1)
        stages = stages or v * max(1, ranks)
        if stages % v:
            raise PlanError(f"stages={stages} is not a multiple of stages_per_rank={v}: each "
                            f"rank runs {v} stages; choose stages= a multiple of {v}")
        data_parallel = data_parallel or max(1, (world or cluster.gpus) // (stages // v))
    # explicit values that cannot match the running ranks: the runtime says what to launch
    mismatch = world is not None and stages is not None and (
        world % stages != 0 or (data_parallel is not None and stages * data_parallel != world))
    if stages is not None and (cluster.gpus == 1 or mismatch or v > 1):  # nothing to search
        p, d = stages, data_parallel or max(1, cluster.gpus // stages)
        batch = replica_batch(example_batch, global_batch_size, d)
        b = micro_batch_of(batch, micro_batch_size, options.grad_accum_steps, p)
        given = Candidate(p, d, b, batch // b)
        name = planner.best_schedule(given)
        shard = given.shard
    else:
        space = Space(cluster.gpus, example_batch, global_batch_size, stages, data_parallel,
                      micro_batch_size, world=world, micro_batches=options.grad_accum_steps)
        # the search is a function of these alone (plan_cache.py): a re-plan that saw them
        # before (a restart, a world size seen before) takes its answer from the cache
        key = plan_cache.search_key(pricer, options, space, example_batch, recompute)
        found = plan_cache.load(key)
        if isinstance(found, plan_cache.Refused):
            raise PlanError(found.message)  # what the search said last time, word for word
        if found is None:
            try:
                found = _search_once(planner, space,
                                     virtual=stages_per_rank is None and schedule == AUTO)
            except PlanError as refused:
                if type(refused) is PlanError:  # (nothing but the message to keep)
                    plan_cache.store(key, plan_cache.Refused(str(refused)))
                raise
            if all(isinstance(s, str) for s in found.sync):  # (a PowerSGD object: not kept)
                plan_cache.store(key, found)
        p, d, b, name = found.stages, found.data_parallel, found.micro_batch_size, found.schedule
        shard, alternatives, searched = found.shard, list(found.alternatives), found.searched
        run_counts, sync = found.run_counts, found.sync
        if stages_per_rank is None and schedule == AUTO:
            v = found.stages_per_rank
            pricer = pricer.per_rank(v)
    m = replica_batch(example_batch, global_batch_size, d) // b
    net = pricer.links(p, d)
    chosen = Candidate(p, d, b, m, shard=shard)
    check_settings(options, chosen, pricer.table.parameter_shapes)
    sched, counts = pricer.built(p, m, name)  # the chosen schedule (schedule="auto")
    if run_counts is not None:
        # the cost-aware order the search checked memory with (a split backward's unit-cost
        # order may hold more: compile then re-cut for counts the search never needed)
        counts = list(run_counts)
    return Configuration(
        stages=p, data_parallel=d, micro_batch_size=b, num_micro_batches=m,
        pipeline_bandwidth=net.partition_bandwidth, allreduce_bandwidth=net.allreduce_bandwidth,
        stash_counts=tuple(counts), schedule=sched, pricer=pricer, alternatives=alternatives,
        device=pricer.spec, node_times=pricer.table.measured, searched_bounds=searched,
        shard_optimizer=shard,
        link_bandwidths=pricer.link_bandwidths(chosen),
        sync_ratio=byte_ratio(sync if sync else
                              [options.replica_sync if options.replica_sync != "auto"
                               else "exact"], pricer.table.parameter_shapes),
        shards_by_default=shards_by_default(options, net, shard),
        search_key=key, compile=decision,
    )


def _search_once(planner: Planner, space: Space, *, virtual: bool) -> plan_cache.Searched:
    """The search's pick (with virtual stages weighed on it where the planner chooses v too),
    as the plan cache keeps it."""
    result = planner.search(space, tolerance=TIE_TOLERANCE)
    if not result.top:
        raise explain_nothing_fits(planner, space)
    best, pricer = result.best, planner.pricer
    p, name, v, alternatives = best.stages, best.schedule, 1, result.alternatives
    if virtual:
        p, name, v, alternatives = _weigh_virtual(pricer, best, alternatives)
        pricer = pricer.per_rank(v)
    searched = None
    if best.plan is not None and v == 1 and p == best.stages:  # unit -> node positions
        searched = tuple(int(pricer.table.units[u]) for u in best.plan.bounds)
    run_counts = None
    if best.run_counts is not None and (p, name) == (best.stages, best.schedule) and \
            len(best.run_counts) == p:
        run_counts = tuple(int(k) for k in best.run_counts)
    return plan_cache.Searched(p, best.data_parallel, best.micro_batch_size, name, best.shard,
                               v, tuple(alternatives), searched, run_counts, tuple(best.sync))


def _weigh_virtual(pricer: Pricer, best: Candidate, rows: list[Alternative]
                   ) -> tuple[int, str, int, list[Alternative]]:
    """(stages, schedule, v, the rows) after weighing virtual stages on ``best``'s ranks
    (``virtual.py``): one that simulates faster is chosen; each becomes a row."""
    pick, stages, name, v = best, best.stages, best.schedule, 1
    found = weigh_virtual(pricer, best)
    for c, sched in found:
        if c.step_time < pick.step_time * (1 - TIE_TOLERANCE):  # a near-tie: not virtual
            pick, stages, name, v = c, c.stages, c.schedule, sched.stages_per_rank
    rows = [dataclasses.replace(a, chosen=False) if a.chosen and pick is not best else a
            for a in rows] + [c.alternative(c is pick) for c, _ in found]
    return stages, name, v, sorted(rows, key=lambda a: a.step_time)


def check_stages_per_rank(schedule: ScheduleChoice, stages_per_rank: int | None) -> int:
    """v for ``schedule``: a virtual schedule runs at least 2 stages per rank, the others (and
    "auto", unless ``stages_per_rank`` is None: see ``_weigh_virtual``) one."""
    virtual = isinstance(schedule, ScheduleSpec) and schedule.virtual
    if stages_per_rank is None:
        return schedule.stages_per_rank if isinstance(schedule, ScheduleSpec) else 1
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) \
            or stages_per_rank < 1:
        raise PlanError(f"stages_per_rank={stages_per_rank!r}: give a positive number of "
                        "stages per rank (1: one stage per rank)")
    if virtual and stages_per_rank < 2:
        assert isinstance(schedule, ScheduleSpec)
        raise PlanError(f"schedule={schedule.name!r} runs several stages per rank: pass "
                        f"stages_per_rank={schedule.stages_per_rank} (or more for "
                        "interleaved-1f1b), or choose a schedule for one stage per rank")
    if not virtual and stages_per_rank > 1:
        raise PlanError(f"stages_per_rank={stages_per_rank} needs a schedule that runs several "
                        "stages per rank: schedule='interleaved-1f1b', 'zbv' or "
                        "'dualpipev'")
    return stages_per_rank


def _planner(gm: fx.GraphModule, cluster: Cluster, schedule: ScheduleChoice, recompute: bool,
             profile: Profile | None, options: PlanOptions,
             stages_per_rank: int, table: CostTable | None = None,
             compiled: CompiledSpeed | None = None, example_batch: int = 1
             ) -> tuple[Planner, CompileDecision]:
    """Costs measured by ``profile`` when it was made on this kind of device, else estimated
    from FLOPs for the cluster's devices; compiled stages' where compile is on (or "auto"
    decides it: ``compiled_speed.decide``) and their speed ``compiled`` is known. ``table``:
    ``CostTable.build(gm)`` made already (a copy is taken: a profile's times are set on it)."""
    table = CostTable.build(gm) if table is None else dataclasses.replace(table)
    network = cluster.network  # measured by Cluster.local() in a launched job
    dtype = str(next((p.dtype for p in gm.parameters()), "float32")).replace("torch.", "")
    # the profile's, this machine's, or none; with the step's overhead learned for this graph
    planning_times(table, cluster, profile, dtype, graph=graph_hash(gm))
    decision = compiled_pricing(table, cluster, options, compiled, example_batch)
    if profile is not None:
        if profile.applies_to(cluster):
            network = profile.network or network
        else:
            warnings.warn(f"the profile was measured on {profile.device!r}, the cluster has "
                          f"{cluster.kind!r} devices: planning with FLOP estimates instead",
                          stacklevel=4)
    planner = Planner(table, cluster, schedule=schedule, recompute=recompute, network=network,
                      shard_optimizer=options.shard_optimizer, stages_per_rank=stages_per_rank,
                      compression=options.compression, replica_sync=options.replica_sync)
    plan_cache.shared_memo(planner.pricer)  # a re-plan for another world reuses its prices
    return planner, decision


def compiled_pricing(table: CostTable, cluster: Cluster, options: PlanOptions,
                     compiled: CompiledSpeed | None, example_batch: int) -> CompileDecision:
    """``options.compile_stages`` resolved with the measured speed (``compiled_speed.decide``:
    the samples of each replica's step and the planner's eager price of one sample), and
    ``table`` priced as compiled stages run where they do (its eager costs set already)."""
    replicas = options.data_parallel or 1
    samples = (options.global_batch_size // replicas if options.global_batch_size
               else example_batch)
    b = min(compiled.sizes[-1], example_batch) if compiled is not None else 1
    per_sample = eager_seconds_per_sample(lambda n: table.node_arrays(n, cluster.spec), b)
    decision = decide(options.compile_stages, cluster, compiled, per_sample, samples,
                      options.planned_steps)
    if decision.speed is not None:  # compiled stages, priced as they run
        table.measured = CompiledTimes(list(table.names), table.measured, decision.speed,
                                       estimate=lambda n: table.estimate(n, cluster.spec))
    return decision


def price(config: Configuration, bounds: tuple[int, ...],
          recompute: tuple[bool, ...] | None = None) -> Priced:
    """Simulate the partition the partition pass made (``bounds``: positions among the compute
    nodes, as ``assign_stages`` returned them) with the schedule object the plan will carry, and
    note the result on the chosen row of the alternatives."""
    pricer = config.pricer
    b, p, m = config.micro_batch_size, config.stages, config.num_micro_batches
    units = pricer.table.unit_arrays(b, pricer.spec, positions=list(bounds))
    d = config.data_parallel
    balancer = pricer.balancer_for(units, p, d if config.shard_optimizer else 1)
    base = config.schedule
    c = Candidate(p, d, b, m, schedule=base.name, shard=config.shard_optimizer)  # (the row shows it)
    c.plan = balancer.partition_costs(list(range(p + 1)))
    # the search ordered schedules with unit costs (cached per P, m); the plan's schedule is
    # generated from this partition's own times (Varuna's order, split backward's W placement)
    # ``recompute``: the partition's per-stage choice (default: the pricer's one setting)
    rc = base.recompute if recompute is None else recompute
    sched = build_schedule(base.spec or base.name, p, m, rc, pricer.schedule_costs(c, rc),
                           stages_per_rank=base.stages_per_rank if base.is_virtual else None)
    counts = peak_stash_counts(sched)
    step = pricer.simulated(c, sched, rc)
    c.memory = tuple(float(x) for x in c.plan.memory(counts, rc))
    rows = tuple(c.alternative(True) if a.chosen else a for a in config.alternatives)
    k = pricer.contention_factor(c, sched)  # as the simulation priced the compute
    busy = c.plan.compute(rc) * k
    terms = cost_terms(step, c.allreduce_time, busy, c.plan.flags(rc), m, units.action * k,
                       pricer.schedule_costs(c, rc).links or (), pricer.step_overhead)
    measured = pricer.table.measured
    spread = getattr(measured, "variation", None)
    return Priced(step, c.memory, rows, sched, tuple(counts), c.compression, c.sync, terms,
                  tuple(float(x) for x in busy), spread or None, priced_here(measured),
                  measured.learn_key if measured is not None else None)


def cost_terms(step: float, allreduce: float, busy: np.ndarray, recomputes: np.ndarray,
               micro_batches: int, action: float, links: Sequence[float],
               step_overhead: float = 0.0) -> tuple[tuple[str, float], ...]:
    """The predicted step as the terms of the cost model, on the busiest stage: its compute
    (operations), the fixed cost of its actions (``machine.py``), the messages over the
    slowest link (one each way per micro-batch), the all-reduce, the step's overhead outside
    its actions (``learned.py``) and the rest (the pipeline's fill and drain: the bubble). An
    account for people and for naming what was off (``drift.py``), not the simulation
    itself."""
    s = int(np.argmax(busy))
    actions = (3 if recomputes[s] else 2) * micro_batches
    overhead = actions * action
    compute = max(micro_batches * float(busy[s]) - overhead, 0.0)
    messages = 2 * micro_batches * max(links, default=0.0)
    rest = max(step - allreduce - compute - overhead - messages - step_overhead, 0.0)
    return (("compute", compute), ("action overhead", overhead), ("messages", messages),
            ("all-reduce", allreduce), ("step overhead", step_overhead), ("bubble", rest))


def assign_and_price(gm: fx.GraphModule, config: Configuration,
                     setting: CostSetting) -> tuple[Partition, Priced]:
    """The partition pass (``assign_stages``) for the stash counts of the schedule that runs,
    weighing each stage's all-reduce over the replicas (``allreduce_terms``), and never slower
    than the search's own partition of the chosen row (``_searched``): the plan's predicted
    step is at most every row the planner lists.

    That schedule is generated from the partition's own costs and recompute flags (``price``),
    so its counts are known only after partitioning, and they differ from the planner's
    schedule's on most Varuna plans. Start from the planner's counts; while the schedule holds
    some stage at more micro-batches than it was partitioned for, partition again at the larger
    count of each stage (counts only grow, up to m: it ends). When the schedule holds fewer,
    one partition at exactly its counts is tried: if that partition's schedule has the same
    counts, it is the fixed point. Otherwise the partition stays the one checked at counts at
    least the schedule's, and its memory is restated at the schedule's counts: the plan, its
    alternatives row and ``Partition.stage_memory`` always print the model at the counts that
    run, and they never exceed what the cap was checked with."""
    costs = dataclasses.replace(partition_problem(gm, setting), **allreduce_terms(config))
    # a configuration planned before (a restart, a world seen before, a pre-planned one):
    # the pass's answer from the cache, priced again (what follows is a function of its inputs)
    key = partition_cache.partition_key(config.search_key, costs, config.stages,
                                        config.stash_counts, config.searched_bounds)
    kept = partition_cache.load(key)
    if kept is not None and kept.bounds[-1] == len(costs.compute):
        record_stages(gm, kept)
        return kept, price(config, kept.bounds, kept.recompute)
    try:
        made, priced = _settled(costs, config)
    except PartitionError:
        # the schedule made from the pass's own costs holds more micro-batches than the search's
        # order did and nothing fits them; the search's own partition of the chosen row was
        # checked with its order's counts: it runs, where it fits as priced here
        if config.searched_bounds is None:
            raise
        fallback = _searched(costs, config)
        if fallback is None:
            raise
        made, priced = fallback
    searched = _searched(costs, config) if config.searched_bounds not in (None, made.bounds) \
        else None
    if searched is not None and searched[1].step_time < priced.step_time:
        made, priced = searched
    partition_cache.store(key, made)
    record_stages(gm, made)
    return made, priced


def _settled(costs: PartitionProblem, config: Configuration) -> tuple[Partition, Priced]:
    """The partition pass at the stash counts its own schedule runs (``assign_and_price``)."""
    counts = config.stash_counts
    safe: tuple[Partition, Priced] | None = None
    while True:
        made = partition(dataclasses.replace(costs, stash_counts=counts), config.stages)
        priced = price(config, made.bounds, made.recompute)
        runs = priced.stash_counts
        if runs == counts:  # checked at exactly the counts that run
            return made, priced
        if safe is not None:  # the exact try did not settle: keep the one that fits
            made, priced = safe
            return dataclasses.replace(made, stage_memory=priced.stage_memory), priced
        if all(r <= c for r, c in zip(runs, counts)):
            safe, counts = (made, priced), runs  # fits a fortiori; try the schedule's own once
        else:
            counts = tuple(max(r, c) for r, c in zip(runs, counts))


def allreduce_terms(config: Configuration) -> dict[str, float | int]:
    """The partition's all-reduce weights (``PartitionProblem``) for the configuration's D."""
    per_byte, latency = config.pricer.links(config.stages, config.data_parallel) \
        .allreduce_terms(config.data_parallel)
    return {"allreduce_per_byte": per_byte * config.sync_ratio, "allreduce_latency": latency,
            "micro_batches": config.num_micro_batches}


def _searched(costs: PartitionProblem, config: Configuration
              ) -> tuple[Partition, Priced] | None:
    """The search's partition of the chosen row, priced as ``assign_and_price`` prices its
    own (checked against memory at stash counts at least those its schedule runs, its memory
    stated at those), or None where it does not fit (or its counts do not settle)."""
    assert config.searched_bounds is not None
    counts = config.stash_counts
    for _ in range(3):
        try:
            made = evaluate(dataclasses.replace(costs, stash_counts=counts),
                            config.searched_bounds)
        except PartitionError:
            return None
        priced = price(config, made.bounds, made.recompute)
        if all(r <= c for r, c in zip(priced.stash_counts, counts)):  # fits a fortiori
            return dataclasses.replace(made, stage_memory=priced.stage_memory), priced
        counts = tuple(max(r, c) for r, c in zip(priced.stash_counts, counts))
    return None


def micro_batch_of(batch: int, micro_batch_size: int | None, micro_batches: int | None,
                   stages: int) -> int:
    """The micro-batch size for a replica batch of ``batch`` samples: the given one, the one
    ``grad_accum_steps`` (``micro_batches``) implies, or about 4 micro-batches per stage."""
    if micro_batches is None:
        b = micro_batch_size or default_micro_batch_size(batch, stages)
    else:
        if batch % micro_batches:
            raise PlanError(f"grad_accum_steps={micro_batches} does not divide the per-replica "
                            f"batch of {batch} (global batch = micro-batch x micro-batches x "
                            f"replicas); choose a divisor of {batch}")
        b = batch // micro_batches
        if micro_batch_size is not None and micro_batch_size != b:
            raise PlanError(f"micro_batch_size={micro_batch_size} x grad_accum_steps="
                            f"{micro_batches} is not the per-replica batch of {batch}: give "
                            "one of them, or values whose product is the per-replica batch")
    check_micro_batch(batch, b)
    return b


def check_micro_batch(batch: int, micro_batch_size: int) -> None:
    if micro_batch_size < 1 or batch % micro_batch_size:
        raise PlanError(
            f"micro_batch_size={micro_batch_size} does not divide the per-replica batch of "
            f"{batch}; choose a divisor of {batch}"
        )
