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
from .capture.inputs import bind_inputs
from .codegen.pass_list import PASS_LIST, PASSES, CompileState, run_pass_list  # noqa: F401 (the list, read here too)
from .codegen.stage_totals import stage_totals
from .costs.wire import ReplicaSync
from .options import CompileOptions, check_compile_arguments, check_devices, check_global_batch
from .passes.annotate_backward import canonical_names
from .passes.manager import dump_dir
from .passes.sample_mixing import (
    graph_findings,
    refuse_layout_dependent_draws,
    warn_sample_mixing,
)
from .pipeline import Pipeline, make_pipeline
from .planner.cluster import Cluster
from .planner.network import rank_links
from .planner.plan import Boundary, Plan
from .runtime.compress import transfer_mode, wire_nbytes
from .runtime.split_backward import input_grads
from .schedule import DEFAULT_SCHEDULE
from .schedule.placement import Placement
from .world.where import resolve_timeout


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
    compression: str = "off",
    replica_sync: ReplicaSync = "exact",
) -> Pipeline:
    """Trace ``model``, cut it into balanced stages and return a runnable :class:`Pipeline`.

    ``profile``: False plans with FLOP estimates; True measures this device (cached on disk);
    a ``varuna_fx.planner.Profile`` uses those measurements. ``dump``: a directory to write
    every pass's graph to (default ``$VARUNA_FX_DUMP``; see ``passes/manager.py``).
    ``recompute``: True / False force it on every stage but the last; "auto" recomputes only
    on the stages whose activations would not fit otherwise (``plan.recompute`` says which).
    ``stages_per_rank``: v stages on each rank (virtual stages: ``schedule="interleaved-1f1b"``
    or ``"zbv"``); the world is then (stages / v) x D ranks. None: the schedule's default.
    ``compression`` / ``replica_sync``: what slow links carry (docs/API.md, "Slow links";
    anything but "off" / "exact" departs from eager numerics by design, and the plan says so).
    """
    # every keyword but the model and its inputs (CompileOptions' fields are exactly these:
    # tests/api/test_options.py), so a new option is a field of its part and a keyword here
    o = CompileOptions(**{k: v for k, v in locals().items()
                          if k not in ("model", "example_inputs")})
    check_compile_arguments(model, example_inputs, o.loss_fn)
    planning = dataclasses.replace(
        o.planning, cluster=o.cluster or Cluster.local(timeout=resolve_timeout(o.timeout)))

    bound = bind_inputs(model, example_inputs)
    check_devices(model, bound.tensors)
    check_global_batch(o.global_batch_size, bound.batch_size)

    # the pass list (codegen/pass_list.py): capture and annotate (cached per model), configure,
    # partition, split and codegen on this compile's own copy of the graph
    state = CompileState(model=model, bound=bound, tracer=o.tracer,
                         canonical=canonical_names(model), planning=planning,
                         profile_split=input_grads)
    run_pass_list(state, dump=dump_dir(o.dump))

    plan = plan_of(state)
    assert state.captured is not None and state.built is not None
    warn_micro_batch_state(model, state.captured.gm, plan.num_micro_batches)
    warn_sample_mixing(f"{type(model).__name__}.forward", graph_findings(state.captured.gm),
                       plan.num_micro_batches)
    refuse_layout_dependent_draws(state.captured.gm, f"{type(model).__name__}.forward",
                                  plan.num_micro_batches, plan.data_parallel)
    return make_pipeline(model, state.captured, state.built, plan, state.canonical, o.running,
                         device=next((t.device for t in bound.tensors.values()), None))


def plan_of(state: CompileState) -> Plan:
    """The plan: everything the pass list decided, priced by one model (the partition's),
    frozen."""
    config, partition, priced = state.config, state.partition, state.priced
    assert config is not None and partition is not None and priced is not None
    assert state.built is not None and state.captured is not None and state.setting is not None
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
