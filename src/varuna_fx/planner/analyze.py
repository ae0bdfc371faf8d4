"""Planning without compiling: capture and annotate a model, then search its configurations.

``vf.compile`` does the same inside its pass list; these entry points serve the command line,
the benchmarks and anyone asking "what would the planner do on a cluster I do not have?".
``Analyzed.plan`` takes the planning options whole (``options.PlanOptions``, as ``varuna-fx
plan`` makes them); ``plan_for`` is the same with keywords.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
from torch import nn

from ..capture.inputs import BoundInputs, bind_inputs
from ..costs.memory import format_bytes
from ..costs.wire import ReplicaSync
from ..errors import PartitionError, PlanError
from ..passes.annotate_backward import canonical_names
from ..passes.frontend import captured_and_annotated
from ..schedule import AUTO, DEFAULT_SCHEDULE, ScheduleSpec
from ..world.where import resolve_timeout
from .candidates import Candidate, SearchResult, Space
from .cluster import Cluster
from .compiled_speed import resolve_speed
from .configure import (
    check_stages_per_rank,
    compiled_pricing,
    micro_batch_of,
    replica_batch,
)
from .cost_table import CostTable
from .explain import explain_nothing_fits
from .machine import planning_times
from .measure import ProfileSettings
from .options import PlanOptions
from .pricing import Pricer
from .profile import Profile, graph_hash
from .resolve import resolve_profile
from .search import Planner
from .steady import TIE_TOLERANCE
from .virtual import on_ranks
from .virtual import weigh as weigh_virtual


@dataclass
class Analyzed:
    """An annotated graph, ready for profiling and planning."""

    gm: fx.GraphModule
    bound: BoundInputs
    model_name: str
    tracer: str
    seconds: dict[str, float] = field(default_factory=dict)  # capture + annotate time

    def table(self, profile: Profile | None = None, cluster: Cluster | None = None) -> CostTable:
        """The cost table, priced as compile prices it on ``cluster`` (``machine.planning_times``;
        without a cluster: ``profile``'s times as measured, or the roofline)."""
        table = CostTable.build(self.gm)
        if cluster is not None:
            dtype = str(next((p.dtype for p in self.gm.parameters()), "float32"))
            # (no collective: plan_for may run on one rank of a job; rank 0 plans as compile)
            planning_times(table, cluster, profile, dtype.replace("torch.", ""), agree=False,
                           graph=graph_hash(self.gm))
        elif profile is not None:
            table.measured = profile.measured_times(table)
        return table

    def profile(self, settings: ProfileSettings | None = None) -> Profile:
        """Measure (or load from the cache) this device's profile of the graph."""
        found = resolve_profile(self.gm, self.bound, True, settings)
        assert found is not None
        return found

    def plan(self, options: PlanOptions, top: int = 5) -> SearchResult:
        """The ``top`` configurations for ``options.cluster`` (None: this machine's,
        ``Cluster.local()``), best first: the best is the choice ``vf.compile`` makes with the
        same options; raises PlanError when none fits. ``options.schedule``: a name, or "auto"
        (each candidate with the fastest schedule that fits: ``result.best.schedule``). A
        schedule of several stages per rank is planned as compile plans it
        (:func:`_plan_virtual`), with ``options.stages_per_rank`` stages per rank (None: the
        schedule's own); ``stages_per_rank=None`` with ``schedule="auto"`` also weighs virtual
        stages on the chosen ranks, as compile does (:func:`_with_virtual`).
        ``options.recompute``: True, False, or "auto" (as if no stage recomputed; when nothing
        fits, as if every stage did; ``result.recompute`` says which). ``options.profile``: a
        Profile (used where it was measured on the cluster's kind of device), True (this
        device's: ``self.profile()``) or False (FLOP estimates)."""
        choice = options.schedule_choice
        virtual = choice != AUTO and choice.virtual
        v = check_stages_per_rank(choice, options.stages_per_rank)
        cluster = options.cluster or Cluster.local(timeout=resolve_timeout(options.timeout))
        profile = self.profile() if options.profile is True else options.profile or None
        use = profile if profile is not None and profile.applies_to(cluster) else None
        space = Space(cluster.gpus, self.bound.batch_size, options.global_batch_size,
                      options.stages, options.data_parallel, options.micro_batch_size,
                      micro_batches=options.grad_accum_steps)

        # priced as compiled stages where compile_stages runs them (a stated or cached
        # speed: nothing is compiled to plan here), as compile prices them
        speed = resolve_speed(self.gm, self.bound, options.compile_stages, cluster, False, None,
                              agree=False)  # (plan_for may run on one rank of a job)

        def search(recompute: bool) -> SearchResult:
            table = self.table(use, cluster)
            compiled_pricing(table, cluster, options, speed, self.bound.batch_size)
            planner = Planner(table, cluster, schedule=choice,
                              recompute=recompute,
                              # as compile: the profile's links, else the cluster's
                              network=(use.network if use else None) or cluster.network,
                              shard_optimizer=options.shard_optimizer,
                              compression=options.compression,
                              replica_sync=options.replica_sync)
            if virtual:  # v stages per rank, as compile plans them
                result = _plan_virtual(planner.pricer, space, dataclasses.replace(
                    planner.pricer.schedules[0], stages_per_rank=v))
            else:
                result = planner.search(space, top=top, tolerance=TIE_TOLERANCE)
                if not result.top:
                    raise explain_nothing_fits(planner, space)
                if options.stages_per_rank is None and choice == AUTO:  # v chosen too
                    result = _with_virtual(planner.pricer, result)
            result.recompute = recompute
            return result

        if options.recompute == "auto":
            try:
                return search(False)
            except PlanError:
                return search(True)
        return search(bool(options.recompute))


def analyze(model: nn.Module, example_inputs: Any, tracer: str = "auto") -> Analyzed:
    """Capture and annotate ``model`` exactly as ``vf.compile`` does (the same passes, and the
    same per-model cache, so a compile afterwards does not capture again)."""
    start = time.perf_counter()
    bound = bind_inputs(model, example_inputs)
    captured = captured_and_annotated(model, bound, tracer, canonical_names(model))
    return Analyzed(captured.gm, bound, type(model).__name__, captured.tracer,
                    {"capture+annotate": time.perf_counter() - start})


def plan_for(graph: Analyzed, cluster: Cluster, *, global_batch_size: int | None = None,
             stages: int | None = None, data_parallel: int | None = None,
             micro_batch_size: int | None = None, grad_accum_steps: int | None = None,
             schedule: str | ScheduleSpec = DEFAULT_SCHEDULE, recompute: bool | str = True,
             profile: Profile | None = None, top: int = 5, stages_per_rank: int | None = 1,
             shard_optimizer: bool | str = False, compression: str = "off",
             replica_sync: ReplicaSync = "exact") -> SearchResult:
    """The best configurations for ``cluster``; raises PlanError when none fits.
    ``schedule``: a name, or "auto" (each candidate with the fastest schedule that fits:
    ``result.best.schedule``). The keywords of :meth:`Analyzed.plan`'s options, meaning what
    ``vf.compile``'s do (by default recompute on and the optimizer state unsharded)."""
    return graph.plan(PlanOptions(
        cluster=cluster, global_batch_size=global_batch_size, stages=stages,
        data_parallel=data_parallel, micro_batch_size=micro_batch_size,
        grad_accum_steps=grad_accum_steps, schedule=schedule if isinstance(schedule, str) else schedule.name, recompute=recompute,
        profile=profile, stages_per_rank=stages_per_rank, shard_optimizer=shard_optimizer,
        compression=compression, replica_sync=replica_sync), top=top)


def _with_virtual(pricer: Pricer, result: SearchResult) -> SearchResult:
    """``result`` after weighing virtual stages on its best candidate's ranks, as
    ``vf.compile`` does for ``stages_per_rank=None, schedule="auto"``
    (``configure._weigh_virtual``): one that simulates faster becomes the best; each is a
    row."""
    best = result.best
    found = weigh_virtual(pricer, best)
    pick = min(found, key=lambda f: f[0].step_time, default=None)
    rows = list(result.alternatives)
    if pick is None or pick[0].step_time >= best.step_time * (1 - TIE_TOLERANCE):
        rows += [c.alternative() for c, _ in found]
        return dataclasses.replace(result, alternatives=sorted(rows, key=lambda a: a.step_time))
    rows = [dataclasses.replace(a, chosen=False) for a in rows]
    rows += [c.alternative(c is pick[0]) for c, _ in found]
    return dataclasses.replace(result, top=[pick[0], *result.top],
                               alternatives=sorted(rows, key=lambda a: a.step_time),
                               stages_per_rank=pick[1].stages_per_rank)


def _plan_virtual(pricer: Pricer, space: Space, kind: ScheduleSpec) -> SearchResult:
    """What ``vf.compile`` plans for a schedule of several stages per rank (v, its entry's):
    P = v x R stages on R ranks per replica (P given, or every device in one replica), D given
    or the replicas the devices hold, the micro-batch size given or about 4 micro-batches per
    stage; nothing is searched but its partition, each stage at 1/v of a device's memory
    (``virtual.on_ranks``). One row. ``pricer``: the setting's, one stage per rank (its
    ``per_rank(v)`` builds the schedule)."""
    start = time.perf_counter()
    v = kind.stages_per_rank
    stages = space.stages or v * max(1, space.gpus // (space.data_parallel or 1))
    if stages % v:
        raise PlanError(f"stages={stages} is not a multiple of stages_per_rank={v}: each rank "
                        f"of {kind.name} runs {v} stages; choose stages= a multiple of {v}")
    ranks = stages // v
    d = space.data_parallel or max(1, space.gpus // ranks)
    if space.gpus > 1 and ranks * d > space.gpus:
        raise PlanError(f"stages={stages} at {v} per rank x data_parallel={d} needs {ranks * d} "
                        f"devices, more than the {space.gpus} there are: choose at most "
                        f"{v * (space.gpus // d)} stages or fewer replicas")
    batch = replica_batch(space.example_batch, space.global_batch_size, d)
    b = micro_batch_of(batch, space.micro_batch_size, space.micro_batches, stages)
    most = pricer.balancer(b).count
    if stages > most:
        raise PartitionError(f"stages={stages} is more than the {most} places the model can "
                             f"be cut: use at most {most - most % v} stages ({v} per rank)")
    priced = on_ranks(pricer, Candidate(ranks, d, b, batch // b), kind)
    if priced is None:
        raise PlanError(
            f"{kind.name} with P={stages} ({v} stages per rank), D={d} and micro-batch size "
            f"{b}: no partition fits {format_bytes(pricer.memory_cap / v)} per stage (1/{v} "
            "of a device's memory); use more devices or more stages, a smaller micro-batch "
            "size, devices with more memory, or a schedule of one stage per rank"
        )
    c = priced[0]
    return SearchResult(top=[c], considered=1, partitioned=1, simulated=1,
                        seconds=time.perf_counter() - start,
                        alternatives=[c.alternative(chosen=True)], stages_per_rank=v)
