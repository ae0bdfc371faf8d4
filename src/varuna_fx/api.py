"""``vf.compile``: options, bound inputs, the pass list, the plan, the pipeline.

The passes themselves, in order, are data in ``codegen/pass_list.py``; compile checks its
options (``options.py``), binds the example inputs, runs the list over one ``CompileState``,
freezes what it decided into a ``Plan`` and hands the pipeline the running options.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .capture.buffers import warn_micro_batch_state
from .capture.captured import Captured
from .capture.inputs import BoundInputs, bind_inputs
from .codegen.pass_list import (  # noqa: F401 (the list, read here too)
    PASS_LIST,
    PASSES,
    CompileState,
    run_after_front_end,
    run_configure_and_assign,
    run_pass_list,
)
from .codegen.stage_module import Stage
from .codegen.stage_totals import stage_totals
from .costs.wire import DiLoCo, ReplicaSync
from .init.allocation import DeferredAllocation
from .init.materialize import check_replayable, is_deferred
from .morph.controller import InPlace
from .morph.fingerprint import fingerprint
from .options import (
    CompileOptions,
    check_compile_arguments,
    check_devices,
    check_global_batch,
    fit_to_world,
)
from .passes.annotate_backward import canonical_names
from .passes.frontend import run_front_end
from .passes.manager import dump_dir
from .passes.sample_mixing import (
    graph_findings,
    refuse_layout_dependent_draws,
    warn_sample_mixing,
)
from .pipeline import Pipeline
from .planner.cluster import Cluster
from .planner.network import rank_links
from .planner.plan import Boundary, Plan, resolve_compile_stages
from .runtime import compiled_stage
from .runtime.compress import transfer_mode, wire_nbytes
from .runtime.distributed import make_distributed_runtime
from .runtime.local import LocalRuntime
from .runtime.loss_weights import find_mean_loss
from .runtime.model_state import StateLayout
from .runtime.options import RunOptions
from .runtime.outputs import OutputAssembler
from .runtime.split_backward import input_grads
from .runtime.step import Runtime
from .runtime.sync.zero import guard_direct_optimizers
from .schedule import DEFAULT_SCHEDULE
from .schedule.placement import Placement
from .world.membership import in_place, joined_settings, joining_running_job, membership
from .world.where import launched_distributed, resolve_timeout, world_size


def compile(  # noqa: A001 - the public name in API.md
    model: nn.Module,
    cluster: Cluster | None = None,
    example_inputs: Any = None,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    global_batch_size: int | None = None,
    stages: int | None = None,
    stages_per_rank: int | None = 1,
    data_parallel: int | None = None,
    micro_batch_size: int | None = None,
    grad_accum_steps: int | None = None,
    schedule: str = DEFAULT_SCHEDULE,
    shard_optimizer: bool | str = "auto",
    recompute: bool | str = "auto",
    tracer: str = "auto",
    offload_stash: bool = False,
    precision: str = "fp32",
    timeout: float | None = None,
    profile: Any = False,
    dump: str | None = None,
    compression: str = "off",
    replica_sync: ReplicaSync = "exact",
    compile_stages: str = "auto",
    compile_wait: bool = False,
    planned_steps: int | None = None,
) -> Pipeline:
    """Trace ``model``, cut it into balanced stages and return a runnable :class:`Pipeline`.

    ``profile``: False plans with FLOP estimates; True measures this device (cached on disk);
    a ``varuna_fx.planner.Profile`` uses those measurements. ``dump``: a directory to write
    every pass's graph to (default ``$VARUNA_FX_DUMP``; see ``passes/manager.py``).
    ``recompute``: True / False force it on every stage but the last; "auto" recomputes only
    on the stages whose activations would not fit otherwise (``plan.recompute`` says which).
    ``stages_per_rank``: v stages on each rank (virtual stages: ``schedule="interleaved-1f1b"``,
    ``"zbv"`` or ``"dualpipev"``); the world is then (stages / v) x D ranks. None: the schedule's default.
    ``grad_accum_steps``: micro-batches per replica per optimizer step (their gradients are
    accumulated): global batch = micro_batch_size x grad_accum_steps x data_parallel.
    ``compression`` / ``replica_sync``: what slow links carry (docs/API.md, "Slow links";
    anything but "off" / "exact" departs from eager numerics by design, and the plan says so).
    ``compile_stages``: "on" runs every stage's forward and backward through torch.compile /
    inductor, "off" eagerly; "auto" compiles on CUDA clusters, and on CPU where the profiler
    measured a gain that ``planned_steps`` steps (default 1000) pay the compile back
    (``planner/compiled_speed.py``; ``plan.compile_stages`` and the plan's title say which,
    ``plan.compile_note`` why, with the measured factor). Where stages run compiled and their
    speed was measured (``profile=True``, or cached from an earlier one), the plan is priced
    with it. Compiled stages run eagerly while they compile in a
    background thread and switch at a step boundary once compiled, so no step waits for a
    compile; ``compile_wait=True`` compiles at the first call instead.
    """
    # every keyword but the model and its inputs (CompileOptions' fields are exactly these:
    # tests/api/test_options.py), so a new option is a field of its part and a keyword here
    o = CompileOptions(**{k: v for k, v in locals().items()
                          if k not in ("model", "example_inputs")})
    check_compile_arguments(model, example_inputs, o.loss_fn)
    bound = bind_inputs(model, example_inputs)
    check_devices(model, bound.tensors)
    check_global_batch(o.global_batch_size, bound.batch_size)

    # the pass list (codegen/pass_list.py): capture and annotate (cached per model), then (once
    # the cluster is known: in a launched job every rank meets the others there, and a process
    # joining a running in-place job waits to be admitted, its graph made already) configure,
    # partition, split and codegen on this compile's own copy of the graph
    dump = dump_dir(o.dump)
    state = CompileState(model=model, bound=bound, tracer=o.tracer,
                         canonical=canonical_names(model), profile_split=input_grads,
                         profile_compile=compile_for_profile)
    run_front_end(state, dump)
    if in_place():  # what this process runs: a running job refuses a joiner that differs
        assert state.captured is not None
        membership().offer(fingerprint(model, state.captured.gm, o))
    cluster = o.cluster or Cluster.local(timeout=resolve_timeout(o.timeout))
    if in_place():  # a morph keeps the global batch; a joining process plans as the others do
        o = fit_to_world(o, world_size(), bound.batch_size, joined_settings())
    state.planning = dataclasses.replace(o.planning, cluster=cluster)
    run_after_front_end(state, dump)

    plan = plan_of(state)
    assert state.captured is not None and state.built is not None
    warn_micro_batch_state(model, state.captured.gm, plan.num_micro_batches)
    warn_sample_mixing(f"{type(model).__name__}.forward", graph_findings(state.captured.gm),
                       plan.num_micro_batches)
    refuse_layout_dependent_draws(state.captured.gm, f"{type(model).__name__}.forward",
                                  plan.num_micro_batches, plan.data_parallel)
    replan = Replan(model, bound, state.canonical, state.captured, o, cluster) \
        if in_place() else None
    return make_pipeline(model, state.captured, state.built, plan, state.canonical, o.running,
                         device=next((t.device for t in bound.tensors.values()), None),
                         replan=replan)


@dataclasses.dataclass(frozen=True)
class Replan:
    """How an in-place morph plans for a new world in this process: compile's options and the
    graph it captured and annotated (``passes/frontend.py``), so a re-plan runs only configure
    and the back passes (``codegen/pass_list.run_after_front_end``)."""

    model: nn.Module
    bound: BoundInputs
    canonical: dict[str, str]
    captured: Captured
    options: CompileOptions
    cluster: Cluster  # what compile planned for (a morph hands the next one's to __call__)

    def __call__(self, cluster: Cluster, global_batch_size: int
                 ) -> tuple[list[Stage], Plan, CompileOptions]:
        """The stages, plan and options for ``cluster.gpus`` ranks with the same global batch
        (the new world's process group is formed: the planner matches its size)."""
        state, o = self._state(cluster, global_batch_size)
        run_after_front_end(state)
        assert state.built is not None
        return state.built, plan_of(state), o

    def search(self, cluster: Cluster, global_batch_size: int) -> None:
        """Only the planner's search and the partition pass for ``cluster.gpus`` ranks (run
        under ``world.where.assumed_world``), their answers kept by the plan cache
        (``planner/cache.py``, ``planner/partition_cache.py``) for the re-plan a morph to that
        world will run (``morph/preplan.py``)."""
        run_configure_and_assign(self._state(cluster, global_batch_size)[0])

    def _state(self, cluster: Cluster, global_batch_size: int
               ) -> tuple[CompileState, CompileOptions]:
        o = fit_to_world(self.options, cluster.gpus, self.bound.batch_size,
                         {"global_batch_size": global_batch_size})
        return CompileState(model=self.model, bound=self.bound, tracer=o.tracer,
                            canonical=self.canonical,
                            planning=dataclasses.replace(o.planning, cluster=cluster),
                            profile_split=input_grads, profile_compile=compile_for_profile,
                            captured=self.captured), o


def compile_for_profile(module: nn.Module) -> Callable[..., Any]:
    """A module compiled as the runtime compiles a stage (``compiled_stage.inductor``, looked
    up at each call so tests may replace it; inductor's caches under the cache service's
    folder): what the profiler times the compiled model with (planner/compiled_speed.py)."""
    compiled_stage.use_cache_dir()
    return compiled_stage.inductor(module)


def plan_of(state: CompileState) -> Plan:
    """The plan: everything the pass list decided, priced by one model (the partition's),
    frozen."""
    config, partition, priced = state.config, state.partition, state.priced
    assert config is not None and partition is not None and priced is not None
    assert state.built is not None and state.captured is not None and state.setting is not None
    decision = config.compile
    compiled, why = (decision.compiled, decision.note) if decision is not None else \
        resolve_compile_stages(state.planning.compile_stages, state.planning.cluster)
    holders: dict[str, list[int]] = {}
    for s in state.built:
        for p in s.parameter_names:
            holders.setdefault(p, []).append(s.index)
    return Plan(
        stages=config.stages, data_parallel=config.data_parallel,
        micro_batch_size=config.micro_batch_size,
        num_micro_batches=config.num_micro_batches, schedule=priced.schedule,
        recompute=tuple(partition.recompute),
        stage_costs=tuple(stage_totals(state.gm, state.built, partition, state.setting,
                                      priced.stage_memory)),
        bounds=tuple(int(x) for x in partition.bounds),
        placement=Placement(config.stages, config.data_parallel,
                            priced.schedule.stages_per_rank,
                            priced.schedule.spec.placement),
        tied_parameters={k: v for k, v in holders.items() if len(v) > 1},
        predicted_step_time=priced.step_time, tracer=state.captured.tracer,
        model_name=type(state.model).__name__, alternatives=priced.alternatives,
        shard_optimizer=config.shard_optimizer,
        shard_optimizer_setting=state.planning.shard_optimizer,
        compression=priced.compression, replica_sync=priced.replica_sync,
        boundaries=boundaries(state), shards_by_default=config.shards_by_default,
        cost_terms=priced.terms, stage_busy=priced.busy, predicted_spread=priced.spread,
        priced_here=priced.priced_here,
        learn_key=priced.learn_key,
        compile_stages=compiled, compile_note=why,
        compile_speedup=decision.speedup if decision is not None and compiled else None,
        compile_setting=state.planning.compile_stages,
    )


def boundaries(state: CompileState) -> tuple[Boundary, ...]:
    """The plan table's row per pipeline boundary: what stage k sends per micro-batch, the
    link it crosses (the plan's pricing of it), how it travels and what that puts on the
    wire (``runtime/compress.py``)."""
    config, priced, built = state.config, state.priced, state.built
    assert config is not None and priced is not None and built is not None
    net = config.pricer.links(config.stages, config.data_parallel)
    if priced.schedule.is_virtual:  # stages of one rank: a boundary never sent
        net = rank_links(config.pricer.links(priced.schedule.num_ranks, config.data_parallel),
                         priced.schedule)
    b = config.micro_batch_size
    rows = []
    for k in range(config.stages - 1):
        sends = built[k].spec.sends
        nbytes = sum(float(t.nbytes(b)) for t in sends)
        wire = sum(wire_nbytes(t.tensor.concrete_shape(b), t.tensor.dtype,
                               transfer_mode(priced.compression, t.src, t.dst)) for t in sends)
        bw = net.bandwidths[k]
        link = "same rank" if bw == float("inf") else \
            "between nodes" if net.is_slow(k) else "within a node"
        rows.append(Boundary(k, float(nbytes), float(wire), link, float(bw),
                             priced.compression[k] if k < len(priced.compression) else "off"))
    return tuple(rows)


def make_pipeline(model: nn.Module, captured: Captured, stages: list[Stage], plan: Plan,
                  canonical: dict[str, str], options: RunOptions, *,
                  device: torch.device | None = None, replan: Replan | None = None) -> Pipeline:
    """The distributed runtime under torchrun (world size > 1), else the one-process one, run
    as ``options`` say. A model built under ``vf.deferred_init`` is materialised on a rank
    only for its stage, while its runtime is made (``distributed.py``); in one process all of
    it on ``device`` (the example inputs'), when the pipeline is first used
    (``init/allocation.py``). ``replan``: in an in-place job, how a morph plans for another
    world in this process (``api.Replan``); a process joining a running job takes its state
    from the members here (``morph/controller.py``)."""
    assemble = OutputAssembler(captured)
    # the model's whole state, before a distributed rank empties what it does not hold
    layout = StateLayout.of(model, canonical, stages)
    runtime: Runtime
    allocation = None
    joining = joining_running_job()
    if launched_distributed():  # each rank allocates its own stages' tensors now
        runtime = make_distributed_runtime(model, captured, stages, plan, canonical, options,
                                           assemble=assemble, layout=layout, joining=joining)
    else:
        # (a graph cut from the captured one, retargeted by the pipeline's allocation)
        mean_loss = find_mean_loss(captured.gm, captured.out_spec, captured.input_names,
                                   options.loss_fn)
        if is_deferred(model):  # allocated when first used (init/allocation.py)
            check_replayable(model)  # what could never be allocated is refused now
            counting = [mean_loss.counting] if mean_loss is not None else []
            allocation = DeferredAllocation(
                model, [captured.gm, *(s.module for s in stages), *counting],
                device or torch.device("cpu"),
                ranks=plan.stages // plan.stages_per_rank * plan.data_parallel)
        runtime = LocalRuntime(stages, plan, options, assemble=assemble,
                               device=allocation.device if allocation else None,
                               mean_loss=mean_loss)
    morphing = InPlace(membership(), replan) if replan is not None else None
    pipe = Pipeline(model, captured, stages, plan, canonical, runtime, options, assemble, layout,
                    allocation, in_place=morphing)
    shard = options.shard_optimizer
    if pipe.replicas > 1 and (shard is True or (shard == "auto" and plan.shard_optimizer)):
        why = "shard_optimizer=True" if shard is True else \
            "the plan shards optimizer state to fit in memory"
        guard_direct_optimizers(pipe.parameters(), f"{why} (ZeRO-1)")
    if pipe.replicas > 1 and any(isinstance(s, DiLoCo) for s in plan.replica_sync):
        guard_direct_optimizers(
            pipe.parameters(), "replica_sync=vf.DiLoCo(...) takes its outer step after every "
            "'every' steps of the optimizer pipe.optimizer made",
            "its steps would never reach the outer step, so the replicas would never meet "
            "again", ", or compile with another replica_sync")
    if morphing is not None:  # (after the guards above: its refusal is the one to show)
        morphing.start(joining)
    return pipe
