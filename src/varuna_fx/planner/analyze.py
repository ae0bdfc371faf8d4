"""Planning without compiling: capture and annotate a model, then search its configurations.

``vf.compile`` does the same inside its pass list; these entry points serve the command line,
the benchmarks and anyone asking "what would the planner do on a cluster I do not have?".
``Analyzed.plan`` takes the planning options whole (``options.PlanOptions``, as ``varuna-fx
plan`` makes them); ``plan_for`` is the same with keywords.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
from torch import nn

from ..capture.inputs import BoundInputs, bind_inputs
from ..errors import PlanError
from ..passes.annotate_backward import canonical_names
from ..passes.frontend import captured_and_annotated
from ..world.where import resolve_timeout
from .candidates import SearchResult, Space
from .cluster import Cluster
from .cost_table import CostTable
from .explain import explain_nothing_fits
from .measure import ProfileSettings
from .options import PlanOptions
from .profile import Profile
from .resolve import resolve_profile
from .search import Planner


@dataclass
class Analyzed:
    """An annotated graph, ready for profiling and planning."""

    gm: fx.GraphModule
    bound: BoundInputs
    model_name: str
    tracer: str
    seconds: dict[str, float] = field(default_factory=dict)  # capture + annotate time

    def table(self, profile: Profile | None = None) -> CostTable:
        table = CostTable.build(self.gm)
        if profile is not None:
            table.measured = profile.measured_times(table)
        return table

    def profile(self, settings: ProfileSettings | None = None) -> Profile:
        """Measure (or load from the cache) this device's profile of the graph."""
        found = resolve_profile(self.gm, self.bound, True, settings)
        assert found is not None
        return found

    def plan(self, options: PlanOptions, top: int = 5) -> SearchResult:
        """The ``top`` configurations for ``options.cluster`` (None: this machine's,
        ``Cluster.local()``), one stage per rank; raises PlanError when none fits.
        ``options.schedule``: a name, or "auto" (each candidate with the fastest schedule that
        fits: ``result.best.schedule``). ``options.recompute``: True, False, or "auto" (as if no
        stage recomputed; when nothing fits, as if every stage did). ``options.profile``: a
        Profile (used where it was measured on the cluster's kind of device), True (this
        device's: ``self.profile()``) or False (FLOP estimates)."""
        if options.stages_per_rank != 1:
            raise PlanError(f"stages_per_rank={options.stages_per_rank!r}: planning without "
                            "compiling searches one stage per rank; vf.compile weighs virtual "
                            "stages on the ranks it chose")
        cluster = options.cluster or Cluster.local(timeout=resolve_timeout(options.timeout))
        profile = self.profile() if options.profile is True else options.profile or None
        use = profile if profile is not None and profile.applies_to(cluster) else None
        space = Space(cluster.gpus, self.bound.batch_size, options.global_batch_size,
                      options.stages, options.data_parallel, options.micro_batch_size)

        def search(recompute: bool) -> SearchResult:
            planner = Planner(self.table(use), cluster, schedule=options.schedule,
                              recompute=recompute, network=use.network if use else None,
                              shard_optimizer=options.shard_optimizer)
            result = planner.search(space, top=top)
            if not result.top:
                raise explain_nothing_fits(planner, space)
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
             micro_batch_size: int | None = None, schedule: str = "varuna",
             recompute: bool = True, profile: Profile | None = None,
             top: int = 5) -> SearchResult:
    """The best configurations for ``cluster``; raises PlanError when none fits.
    ``schedule``: a name, or "auto" (each candidate with the fastest schedule that fits:
    ``result.best.schedule``). The keywords of :meth:`Analyzed.plan`'s options (optimizer
    state unsharded)."""
    return graph.plan(PlanOptions(
        cluster=cluster, global_batch_size=global_batch_size, stages=stages,
        data_parallel=data_parallel, micro_batch_size=micro_batch_size, schedule=schedule,
        recompute=recompute, profile=profile, shard_optimizer=False), top=top)
