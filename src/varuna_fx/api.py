"""``vf.compile``: the ordered list of passes from an ``nn.Module`` to a running pipeline."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .capture.buffers import warn_micro_batch_state
from .capture.captured import Captured
from .capture.inputs import BoundInputs, bind_inputs
from .codegen.stage_module import Stage, build_stage
from .codegen.stage_totals import stage_totals
from .costs.roofline import device_spec
from .errors import PlanError
from .ir.nodes import copy_graph_module
from .options import (
    CompileOptions,
    check_compile_arguments,
    check_devices,
    check_global_batch,
    fit_to_world,
)
from .passes.annotate_backward import canonical_names
from .passes.assign_stages import CostSetting
from .passes.check import check_assignment, check_parameters, check_split
from .passes.frontend import FRONT_PASSES, captured_and_annotated
from .passes.manager import CompileState, Pass, dump_dir, run_passes
from .passes.sample_mixing import graph_findings, warn_sample_mixing
from .passes.split_stages import split_stages
from .pipeline import Pipeline, make_pipeline
from .planner.cluster import Cluster
from .planner.configure import Configuration, assign_and_price, choose_configuration
from .planner.measure import ProfileSettings
from .planner.plan import Plan
from .planner.resolve import resolve_profile
from .runtime.split_backward import input_grads
from .schedule import AUTO, DEFAULT_SCHEDULE
from .schedule.placement import Placement
from .world.membership import in_place, joined_settings
from .world.where import resolve_timeout, world_size


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
    schedule: str = DEFAULT_SCHEDULE,
    shard_optimizer: bool | str = "auto",
    recompute: bool | str = "auto",
    tracer: str = "auto",
    offload_stash: bool = False,
    precision: str = "fp32",
    timeout: float | None = None,
    profile: Any = False,
    dump: str | None = None,
) -> Pipeline:
    """Trace ``model``, cut it into balanced stages and return a runnable :class:`Pipeline`.

    ``profile``: False plans with FLOP estimates; True measures this device (cached on disk);
    a ``varuna_fx.planner.Profile`` uses those measurements. ``dump``: a directory to write
    every pass's graph to (default ``$VARUNA_FX_DUMP``; see ``passes/manager.py``).
    ``recompute``: True / False force it on every stage but the last; "auto" recomputes only
    on the stages whose activations would not fit otherwise (``plan.recompute`` says which).
    ``stages_per_rank``: v stages on each rank (virtual stages: ``schedule="interleaved-1f1b"``
    or ``"zbv"``); the world is then (stages / v) x D ranks. None: the schedule's default.
    """
    o = CompileOptions(
        cluster=cluster, loss_fn=loss_fn, global_batch_size=global_batch_size, stages=stages,
        stages_per_rank=stages_per_rank, data_parallel=data_parallel,
        micro_batch_size=micro_batch_size, schedule=schedule, recompute=recompute, tracer=tracer,
        offload_stash=offload_stash, precision=precision, timeout=timeout, profile=profile,
        shard_optimizer=shard_optimizer, dump=dump)
    check_compile_arguments(model, example_inputs, o.loss_fn)
    cluster = o.cluster or Cluster.local(timeout=resolve_timeout(o.timeout))
    where_to = dump_dir(o.dump)

    # capture + annotate (FRONT_PASSES, cached per model): shapes and costs as functions of b
    bound = bind_inputs(model, example_inputs)
    check_devices(model, bound.tensors)
    check_global_batch(o.global_batch_size, bound.batch_size)
    canonical = canonical_names(model)
    captured = captured_and_annotated(model, bound, o.tracer, canonical, where_to)
    if in_place():  # a morph keeps the global batch; a joiner plans as the survivors do
        o = fit_to_world(o, world_size(), bound.batch_size, joined_settings())

    # configure, then partition, split, codegen (BACK_PASSES) on this compile's own graph copy
    built, plan = plan_and_build(model, captured, bound, canonical, o, cluster, where_to)
    warn_micro_batch_state(model, captured.gm, plan.num_micro_batches)
    warn_sample_mixing(f"{type(model).__name__}.forward", graph_findings(captured.gm),
                       plan.num_micro_batches)
    replan = Replan(model, captured, bound, canonical, o, cluster) if in_place() else None
    pipe = make_pipeline(model, captured, built, plan, canonical, loss_fn=o.loss_fn,
                         offload_stash=o.offload_stash, precision=o.precision,
                         timeout=o.timeout,
                         shard_optimizer=o.shard_optimizer,
                         device=next((t.device for t in bound.tensors.values()), None),
                         replan=replan)
    if o.global_batch_size is not None:
        pipe._replica_batch = o.global_batch_size // plan.data_parallel
    return pipe


def plan_and_build(model: nn.Module, captured: Captured, bound: BoundInputs,
                   canonical: dict[str, str], o: CompileOptions, cluster: Cluster,
                   where_to: Path | None = None) -> tuple[list[Stage], Plan]:
    """configure (P, D, the micro-batch size and the schedule, given or chosen), then the back
    passes on a copy of the captured graph: the stages and the frozen plan. ``vf.compile`` runs
    it once; an in-place morph runs it again for the new world (``Replan``) on the same
    captured, annotated graph, so a re-plan costs no capture and no annotation."""

    # configure: P, D and the micro-batch size (given, or chosen from measured or estimated
    # costs); the planner also builds the schedule object the plan will carry
    def configure(rc: bool) -> Configuration:
        return choose_configuration(
            captured.gm, cluster, example_batch=bound.batch_size,
            global_batch_size=o.global_batch_size, stages=o.stages,
            data_parallel=o.data_parallel, micro_batch_size=o.micro_batch_size,
            schedule=o.schedule_choice, recompute=rc,
            profile=resolve_profile(captured.gm, bound, o.profile, settings, timeout=o.timeout),
            shard_optimizer=o.shard_optimizer,
            stages_per_rank=o.stages_per_rank,
        )

    # a split-backward schedule is planned with its input-gradient and weight passes timed
    # by the runtime's own split (they cost more than the fused backward)
    choice = o.schedule_choice
    settings = ProfileSettings(split=input_grads) \
        if choice == AUTO or choice.split_backward else None

    if o.recompute == "auto":
        # plan as if nothing recomputed (the fastest when memory allows); only if no
        # configuration fits that way, as if every stage did. The partition pass then
        # decides per stage.
        try:
            config = configure(False)
        except PlanError:
            config = configure(True)
    else:
        config = configure(bool(o.recompute))

    # partition, split, codegen (BACK_PASSES) on this compile's own copy of the graph
    state = CompileState(model, copy_graph_module(captured.gm), values={
        "config": config, "canonical": canonical, "model_name": type(model).__name__,
        "setting": CostSetting(
            micro_batch_size=config.micro_batch_size,
            device=config.device or device_spec(cluster.device),
            bandwidth=config.pipeline_bandwidth,
            memory_cap=cluster.gpu_memory / config.schedule.stages_per_rank,
            stash_counts=config.stash_counts, recompute=o.recompute,
            node_times=config.node_times,
            optimizer_shards=config.data_parallel if config.shard_optimizer else 1,
        ),
    })
    run_passes(BACK_PASSES, state, dump=where_to, done=FRONT_PASSES)
    built = state["built"]

    # the plan: everything decided, priced by one model (the partition's), frozen
    bounds = tuple(int(x) for x in state["partition"].bounds)
    flags = tuple(state["partition"].recompute)
    priced = state["priced"]
    holders: dict[str, list[int]] = {}
    for s in built:
        for p in s.parameter_names:
            holders.setdefault(p, []).append(s.index)
    plan = Plan(
        stages=config.stages, data_parallel=config.data_parallel,
        micro_batch_size=config.micro_batch_size,
        num_micro_batches=config.num_micro_batches, schedule=priced.schedule,
        recompute=flags,
        stage_costs=tuple(stage_totals(state.gm, built, state["partition"], state["setting"],
                                      priced.stage_memory)),
        bounds=bounds, placement=Placement(config.stages, config.data_parallel,
                                           priced.schedule.stages_per_rank,
                                           priced.schedule.spec.placement),
        tied_parameters={k: v for k, v in holders.items() if len(v) > 1},
        predicted_step_time=priced.step_time, tracer=captured.tracer,
        model_name=type(model).__name__, alternatives=priced.alternatives,
        shard_optimizer=config.shard_optimizer,
    )
    return built, plan


@dataclass(frozen=True)
class Replan:
    """What an in-place morph calls to plan for a new world in this process: compile's options
    and the captured, annotated graph it already made (``passes/frontend.py``)."""

    model: nn.Module
    captured: Captured
    bound: BoundInputs
    canonical: dict[str, str]
    options: CompileOptions
    cluster: Cluster

    def __call__(self, cluster: Cluster, global_batch_size: int) -> tuple[list[Stage], Plan]:
        """The stages and plan for ``cluster.gpus`` ranks, with the same global batch (the
        process group of the new world is formed: the planner matches its size)."""
        o = fit_to_world(self.options, cluster.gpus, self.bound.batch_size,
                         {"global_batch_size": global_batch_size})
        return plan_and_build(self.model, self.captured, self.bound, self.canonical, o, cluster)


# -- the back passes, as data ------------------------------------------------------------------


def _assign(state: CompileState) -> None:
    # partitioned for the stash counts of the schedule that runs, and priced with it
    state["partition"], state["priced"] = assign_and_price(state.gm, state["config"],
                                                          state["setting"])


def _split(state: CompileState) -> None:
    model, canonical = state.model, state["canonical"]
    trainable = {canonical[n] for n, p in model.named_parameters(remove_duplicate=False)
                 if p.requires_grad}
    state["stage_graphs"] = split_stages(state.gm, state["config"].stages, trainable)


def _codegen(state: CompileState) -> None:
    model, canonical = state.model, state["canonical"]
    order = list(dict.fromkeys(canonical.values()))
    params = {canonical[n] for n, _ in model.named_parameters(remove_duplicate=False)}
    state["built"] = [build_stage(state.gm, sg, state["config"].stages, order,
                                  state["model_name"], params, [p.name for p in PASSES])
                      for sg in state["stage_graphs"]]


BACK_PASSES: tuple[Pass, ...] = (
    Pass("assign_stages", "every compute node has a stage; stages are contiguous in "
         "topological order (exact DP on the bottleneck under the memory cap)", _assign,
         lambda s: check_assignment(s.gm, s["config"].stages)),
    Pass("split_stages", "one fx.Graph per stage with explicit receives (placeholders) and "
         "sends (output dict); gradient-carrying transfers decided statically", _split,
         lambda s: check_split(s.gm, s["stage_graphs"])),
    Pass("codegen", "a GraphModule per stage holding exactly its parameters under original "
         "FQNs, and its readable source", _codegen,
         lambda s: check_parameters(s.gm, [b.parameter_names + b.spec.buffer_names
                                           for b in s["built"]], s["canonical"])),
)
PASSES: tuple[Pass, ...] = FRONT_PASSES + BACK_PASSES  # the whole list, in order

