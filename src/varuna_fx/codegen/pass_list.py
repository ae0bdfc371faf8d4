"""``vf.compile``'s pass list, as data: every pass in order, configure included.

:data:`PASS_LIST` is the front end (passes 1-6: capture and the annotation passes, defined
beside their cache in ``passes/frontend.py`` because the planner's ``analyze`` runs them too),
then ``configure`` (the planner's choice of P, D, the micro-batch size and the schedule: a step
that leaves the graph as it is, so it is neither numbered nor dumped), ``assign_stages``,
``split_stages`` and ``codegen``. Each entry is a ``passes/manager.Pass``: a function over one
:class:`CompileState`, with its checker. :func:`run_pass_list` runs the list for ``vf.compile``:
the front end through its cache (once per captured graph), the rest on this compile's own copy
of the graph. The eval-mode recompile (``modes.py``) runs the same list with one substitution:
no configure, and stages assigned by which compiled stage holds each parameter.

A new pass is one entry here (and its function and checker in its own module); its results are
a typed field of :class:`CompileState`.

It sits in codegen/, the lowest layer that sees every step (the planner's configure and
partition, ``split_stages``, ``build_stage``); the runtime's split backward, which configure's
profiler times for a split-backward schedule, comes in the state (the runtime is above).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..costs.roofline import device_spec
from ..errors import PlanError
from ..ir.nodes import copy_graph_module
from ..passes.assign_stages import CostSetting
from ..passes.check import check_assignment, check_parameters, check_split
from ..passes.frontend import FRONT_PASSES, FrontState, run_front_end
from ..passes.manager import Pass, graph_passes, run_passes
from ..passes.partition import Partition
from ..passes.split_stages import split_stages
from ..planner.compiled_speed import resolve_speed, should_measure
from ..planner.configure import Configuration, Priced, assign_and_price, choose_configuration
from ..planner.cost_table import CostTable
from ..planner.measure import ProfileSettings
from ..planner.options import PlanOptions
from ..planner.resolve import resolve_profile
from ..schedule import AUTO
from .stage_module import Stage, build_stage


@dataclass(kw_only=True)
class CompileState(FrontState):
    """Everything one compile knows: what it starts from (the front end's fields, the planning
    options), then each pass's results, filled in list order."""

    planning: PlanOptions | None = None  # configure's input, its cluster given (None: no configure)
    # the runtime's split backward (``runtime.split_backward.input_grads``): configure's profiler
    # times a split-backward schedule's two passes with it
    profile_split: Callable[..., Any] | None = None
    # how the runtime compiles a stage (``api.compile_for_profile``): the profiler times the
    # compiled model with it where compile is on or "auto" (planner/compiled_speed.py)
    profile_compile: Callable[..., Any] | None = None
    pass_list: tuple[Pass, ...] = ()  # the list being run (codegen's header names its passes)
    config: Configuration | None = None  # configure: P, D, b, m and the simulated schedule
    setting: CostSetting | None = None  # configure: what the partition prices nodes with
    num_stages: int = 0  # configure (or given: the eval-mode recompile)
    partition: Partition | None = None  # assign_stages
    priced: Priced | None = None  # assign_stages: the partition priced by the planner's model
    built: list[Stage] | None = None  # codegen: one Stage per stage graph


def _configure(state: CompileState) -> None:
    """P, D and the micro-batch size (given, or chosen from measured or estimated costs); the
    planner also builds the schedule object the plan will carry."""
    o = state.planning
    assert o is not None and o.cluster is not None, "compile gives configure its cluster"
    # a split-backward schedule is planned with its input-gradient and weight passes timed by
    # the runtime's own split (they cost more than the fused backward)
    settings = ProfileSettings(split=state.profile_split) \
        if o.schedule_choice == AUTO or o.schedule_choice.split_backward else None

    table = CostTable.build(state.gm)  # (once for both tries of recompute="auto")

    def choose(recompute: bool) -> Configuration:
        profile = resolve_profile(state.gm, state.bound, o.profile, settings, timeout=o.timeout)
        # the compiled stages' speed, where they may run compiled: measured with the profile
        # (profile=True, compiled_speed.should_measure), else a cached or stated one
        assert o.cluster is not None
        measure = should_measure(o.compile_stages, o.cluster, o.profile, o.planned_steps)
        speed = resolve_speed(state.gm, state.bound, o.compile_stages, o.cluster, measure,
                              state.profile_compile, o.timeout)
        return choose_configuration(state.gm, o, example_batch=state.bound.batch_size,
                                    recompute=recompute, profile=profile, table=table,
                                    compiled=speed)

    if o.recompute == "auto":
        # plan as if nothing recomputed (the fastest when memory allows); only if no
        # configuration fits that way, as if every stage did. The partition pass then
        # decides per stage.
        try:
            config = choose(False)
        except PlanError:
            config = choose(True)
    else:
        config = choose(bool(o.recompute))
    state.config, state.num_stages = config, config.stages
    state.setting = CostSetting(
        micro_batch_size=config.micro_batch_size,
        device=config.device or device_spec(o.cluster.device),
        bandwidth=config.pipeline_bandwidth,
        memory_cap=o.cluster.gpu_memory / config.schedule.stages_per_rank,
        stash_counts=config.stash_counts, recompute=o.recompute,
        node_times=config.node_times,
        optimizer_shards=config.data_parallel if config.shard_optimizer else 1,
        bandwidths=config.link_bandwidths,
    )


def _assign(state: CompileState) -> None:
    # partitioned for the stash counts of the schedule that runs, and priced with it
    assert state.config is not None and state.setting is not None
    state.partition, state.priced = assign_and_price(state.gm, state.config, state.setting)


def _split(state: CompileState) -> None:
    model, canonical = state.model, state.canonical
    trainable = {canonical[n] for n, p in model.named_parameters(remove_duplicate=False)
                 if p.requires_grad}
    state.stage_graphs = split_stages(state.gm, state.num_stages, trainable)


def _codegen(state: CompileState) -> None:
    model, canonical = state.model, state.canonical
    order = list(dict.fromkeys(canonical.values()))
    params = {canonical[n] for n, _ in model.named_parameters(remove_duplicate=False)}
    assert state.gm is not None and state.stage_graphs is not None
    state.built = [build_stage(state.gm, sg, state.num_stages, order, type(model).__name__,
                               params, graph_passes(state.pass_list))
                   for sg in state.stage_graphs]


def _held(state: CompileState) -> list[list[str]]:
    assert state.built is not None
    return [b.parameter_names + b.spec.buffer_names for b in state.built]


CONFIGURE: Pass[CompileState] = Pass(
    "configure", "P, D, the micro-batch size (given or chosen) and the Schedule the planner "
    "simulated; the cost setting the partition prices nodes with", _configure, graph=False)
ASSIGN_STAGES: Pass[CompileState] = Pass(
    "assign_stages", "every compute node has a stage; stages are contiguous in topological "
    "order (exact DP on the bottleneck under the memory cap)", _assign,
    lambda s: check_assignment(s.gm, s.num_stages))
SPLIT_STAGES: Pass[CompileState] = Pass(
    "split_stages", "one fx.Graph per stage with explicit receives (placeholders) and sends "
    "(output dict); gradient-carrying transfers decided statically", _split,
    lambda s: check_split(s.gm, s.stage_graphs))
CODEGEN: Pass[CompileState] = Pass(
    "codegen", "a GraphModule per stage holding exactly its parameters under original FQNs, "
    "and its readable source", _codegen,
    lambda s: check_parameters(s.gm, _held(s), s.canonical))

# the whole list, in order
PASS_LIST: tuple[Pass[CompileState], ...] = (
    *FRONT_PASSES, CONFIGURE, ASSIGN_STAGES, SPLIT_STAGES, CODEGEN)
# the passes of the list that change the graph, numbered as the dumps and stage headers number
# them (configure is not one)
PASSES: tuple[Pass[CompileState], ...] = tuple(p for p in PASS_LIST if p.graph)


def run_pass_list(state: CompileState, dump: Path | None = None) -> None:
    """Run :data:`PASS_LIST` over ``state`` (``planning`` given): the front end from the cache
    when a fresh capture equals the cached graph (``passes/frontend.py``), then every later
    pass on a copy of it (``ir.copy_graph_module``: pipelines compiled from one cached graph do
    not change each other). ``dump``: a directory for every graph pass's graph."""
    run_front_end(state, dump)
    run_after_front_end(state, dump)


def run_configure_and_assign(state: CompileState) -> None:
    """configure and the partition pass on a copy of ``state.captured``'s graph: the
    planner's search and the partition, whose answers the plan cache keeps (a pre-plan for
    another world: ``morph/preplan.py``)."""
    assert state.captured is not None, "the front end ran (or its result was given)"
    state.gm = copy_graph_module(state.captured.gm)
    _configure(state)
    _assign(state)


def run_after_front_end(state: CompileState, dump: Path | None = None) -> None:
    """The passes after the front end (configure, assign_stages, split_stages, codegen) on a
    copy of ``state.captured``'s graph, captured and annotated already: what an in-place morph
    runs to plan for another world in a process that compiled before (``api.Replan``)."""
    assert state.captured is not None, "the front end ran (or its result was given)"
    state.pass_list = PASS_LIST
    front, rest = PASS_LIST[:len(FRONT_PASSES)], PASS_LIST[len(FRONT_PASSES):]
    assert front == FRONT_PASSES
    state.gm = copy_graph_module(state.captured.gm)
    run_passes(rest, state, dump=dump, done=front)
