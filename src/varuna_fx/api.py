"""``vf.compile``: the ordered list of passes from an ``nn.Module`` to a running pipeline."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import schedule as schedules
from .buffers import warn_micro_batch_state
from .capture import TRACERS, BoundInputs, Captured, bind_inputs, capture
from .cluster import Cluster
from .codegen import build_stage
from .configure import Configuration, choose_configuration
from .costmodel import device_spec
from .errors import VarunaFxError
from .passes.annotate_costs import annotate_costs, canonical_names
from .passes.annotate_shapes import annotate_shapes
from .passes.assign_stages import CostSetting, assign_stages
from .passes.check import check_assignment, check_parameters, check_split
from .passes.mark_replicable import mark_replicable
from .passes.specialize_sizes import specialize_sizes
from .passes.split_stages import split_stages
from .pipeline import Pipeline
from .plan import Plan
from .plan_costs import stage_costs
from .planner.resolve import resolve_profile


def compile(  # noqa: A001 - the public name in API.md
    model: nn.Module,
    cluster: Cluster | None = None,
    example_inputs: Any = None,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    global_batch_size: int | None = None,
    stages: int | None = None,
    data_parallel: int | None = None,
    micro_batch_size: int | None = None,
    schedule: str = "varuna",
    recompute: bool = True,
    tracer: str = "auto",
    offload_stash: bool = False,
    precision: str = "fp32",
    timeout: float | None = None,
    profile: Any = False,
) -> Pipeline:
    """Trace ``model``, cut it into balanced stages and return a runnable :class:`Pipeline`.

    ``profile``: False plans with FLOP estimates; True measures this device (cached on disk);
    a ``varuna_fx.planner.Profile`` uses those measurements.
    """
    _check_arguments(model, example_inputs, schedule, tracer, stages)
    cluster = cluster or Cluster.local()

    # 1. capture: model -> one flat fx graph over tensor inputs, original FQNs kept
    # 2. annotate: shapes and costs as functions of the micro-batch size b
    bound = bind_inputs(model, example_inputs)
    canonical = canonical_names(model)
    captured = _captured_and_annotated(model, bound, tracer, canonical)
    gm = captured.gm

    # 3. configure: P, D and the micro-batch size (given, or chosen from measured or
    #    estimated costs)
    config: Configuration = choose_configuration(
        gm, cluster, example_batch=bound.batch_size, global_batch_size=global_batch_size,
        stages=stages, data_parallel=data_parallel, micro_batch_size=micro_batch_size,
        schedule=schedule, recompute=recompute, profile=resolve_profile(gm, bound, profile),
    )

    # 4. partition: a stage for every operation, balanced by cost
    setting = CostSetting(
        micro_batch_size=config.micro_batch_size,
        device=config.device or device_spec(cluster.device),
        bandwidth=config.pipeline_bandwidth, memory_cap=cluster.gpu_memory,
        in_flight=config.in_flight, recompute=recompute, node_times=config.node_times,
    )
    partition = assign_stages(gm, config.stages, setting)
    check_assignment(gm, config.stages)

    # 5. split + codegen: one readable GraphModule per stage, explicit boundaries
    trainable = {canonical[n] for n, p in model.named_parameters(remove_duplicate=False)
                 if p.requires_grad}
    stage_graphs = split_stages(gm, config.stages, trainable)
    check_split(gm, stage_graphs)
    order = list(dict.fromkeys(canonical.values()))
    name = type(model).__name__
    params = {canonical[n] for n, _ in model.named_parameters(remove_duplicate=False)}
    built = [build_stage(gm, sg, config.stages, order, name, params) for sg in stage_graphs]
    check_parameters(gm, [s.parameter_names + s.spec.buffer_names for s in built], canonical)

    # 6. plan + runtime
    costs = stage_costs(gm, built, partition, setting)
    holders: dict[str, list[int]] = {}
    for s in built:
        for p in s.parameter_names:
            holders.setdefault(p, []).append(s.index)
    plan = Plan(
        stages=config.stages, data_parallel=config.data_parallel,
        micro_batch_size=config.micro_batch_size,
        num_micro_batches=config.num_micro_batches, schedule=schedule, recompute=recompute,
        stage_costs=costs, tied_parameters={k: v for k, v in holders.items() if len(v) > 1},
        tracer=captured.tracer, model_name=name, alternatives=config.alternatives,
    )
    plan.predicted_step_time = config.predict(plan)
    warn_micro_batch_state(model, gm, plan.num_micro_batches)
    from .runtime.launch import make_runtime  # the runtime depends on how we were launched

    return make_runtime(model, captured, built, plan, canonical, loss_fn=loss_fn,
                        offload_stash=offload_stash, precision=precision, timeout=timeout)


# Re-compiling the same model (another P, schedule or micro-batch size, as one does while
# exploring in a notebook) reuses its annotated graph. The model is captured afresh every time
# and the key is what that capture produced (the graph's code, with attributes such as
# ``self.alpha`` baked in as constants; the type and settings of every module it calls; the
# identity of every parameter and buffer; tensor constants; modes), so a hit is exactly what a
# fresh compile would annotate. It skips the fake-tensor runs and cost passes (~75% of a
# compile: bench/RESULTS.md, "Capture cache").
_CAPTURES: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Captured]] = \
    weakref.WeakKeyDictionary()


def _fingerprint(model: nn.Module, captured: Captured, bound: BoundInputs) -> tuple:
    gm = captured.gm
    tensors = tuple((n, tuple(t.shape), t.dtype, t.device) for n, t in bound.tensors.items())
    state = tuple((n, id(t), tuple(t.shape), t.dtype) for n, t in
                  [*model.named_parameters(remove_duplicate=False),
                   *model.named_buffers(remove_duplicate=False)])
    owned = {id(t) for t in [*model.parameters(), *model.buffers()]}
    constants = tuple((n, t.dtype, tuple(t.shape), _content(t))
                      for n, t in [*gm.named_parameters(), *gm.named_buffers()]
                      if id(t) not in owned)
    called = tuple((str(n.target), _module_settings(gm.get_submodule(str(n.target))))
                   for n in gm.graph.nodes if n.op == "call_module")
    modes = tuple(m.training for m in model.modules())
    return (captured.tracer, gm.code, tensors, tuple(sorted(bound.constants.items(), key=str)),
            state, constants, called, modes)


def _content(t: torch.Tensor) -> int:
    return hash(t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())


def _module_settings(module: nn.Module) -> tuple:
    """A called module's type and plain settings (``p`` of Dropout, ``eps`` of LayerNorm...)."""
    plain = (bool, int, float, str, type(None), tuple)
    return (type(module), tuple(sorted((k, repr(v)) for k, v in vars(module).items()
                                       if isinstance(v, plain))))


def _captured_and_annotated(model: nn.Module, bound: BoundInputs, tracer: str,
                            canonical: dict[str, str]) -> Captured:
    captured = capture(model, bound, tracer)
    key = _fingerprint(model, captured, bound)
    cached = _CAPTURES.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    annotate_shapes(captured.gm, bound)
    specialize_sizes(captured.gm)
    annotate_costs(captured.gm, canonical)
    mark_replicable(captured.gm)
    _CAPTURES[model] = (key, captured)
    return captured


def _check_arguments(model: Any, example_inputs: Any, schedule: str, tracer: str,
                     stages: int | None) -> None:
    if not isinstance(model, nn.Module):
        raise VarunaFxError(f"compile expects a torch.nn.Module, got {type(model).__name__}")
    if example_inputs is None:
        raise VarunaFxError(
            "example_inputs is required: a tuple of positional args or a dict of keyword args "
            "for one sample batch (dim 0 of every tensor is the batch)"
        )
    if schedule not in schedules.SCHEDULES:
        raise VarunaFxError(
            f"schedule={schedule!r} is unknown; choose one of {sorted(schedules.SCHEDULES)}"
        )
    if tracer not in TRACERS:
        raise VarunaFxError(f"tracer={tracer!r} is unknown; choose one of {TRACERS}")
    if stages is not None and (not isinstance(stages, int) or stages < 1):
        raise VarunaFxError(f"stages={stages!r}: give a positive number of pipeline stages")
