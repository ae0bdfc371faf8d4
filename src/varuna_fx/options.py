"""``vf.compile``'s options: one frozen object, checked once, before any work is done.

:class:`CompileOptions` holds every keyword ``vf.compile`` takes besides the model and its
example inputs (the torchtitan way: a frozen options object rather than arguments passed
along one by one). Making one checks all of them, each error saying which option is wrong and
what to pass instead; the rest of ``compile`` reads the checked object. ``bool`` is refused
where a count is expected: ``True`` is an ``int`` in Python, and ``stages=True`` meaning one
stage is never what the user meant.

What depends on the model or its bound inputs (the model's type, example inputs given, their
devices, a ``target`` parameter) is checked here too, by the functions below, once compile has
them.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from torch import nn

from .capture.trace import TRACERS
from .errors import InputError, VarunaFxError
from .planner.cluster import Cluster
from .runtime.precision import check_precision
from .schedule import DEFAULT_SCHEDULE, ScheduleChoice, resolve_schedule
from .world.where import resolve_timeout


@dataclass(frozen=True)
class CompileOptions:
    """The options of one ``vf.compile`` call (docs/API.md has their meaning), valid once
    made."""

    cluster: Cluster | None = None  # None: Cluster.local()
    loss_fn: Callable[..., Any] | None = None
    global_batch_size: int | None = None
    stages: int | None = None
    stages_per_rank: int | None = 1  # None: the schedule's default (the planner checks it)
    data_parallel: int | None = None
    micro_batch_size: int | None = None
    schedule: str = DEFAULT_SCHEDULE
    recompute: bool | str = "auto"
    tracer: str = "auto"
    offload_stash: bool = False
    shard_optimizer: bool | str = "auto"  # ZeRO-1 over each stage's D replicas
    precision: str = "fp32"
    timeout: float | None = None  # None: $VARUNA_FX_TIMEOUT or the default, when waited on
    profile: Any = False  # False | True | a varuna_fx.planner.Profile (resolve_profile checks)
    dump: str | None = None

    def __post_init__(self) -> None:
        if self.cluster is not None and not isinstance(self.cluster, Cluster):
            raise VarunaFxError(
                f"cluster={_short(self.cluster)} is not a vf.Cluster: the second positional "
                "argument of vf.compile is the cluster; pass the inputs as example_inputs=(...)"
            )
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise VarunaFxError(f"loss_fn={_short(self.loss_fn)} is not callable: pass a "
                                "function loss_fn(output, target) -> 0-d tensor, or None")
        named = (("schedule", self.schedule, "varuna"), ("tracer", self.tracer, "auto"),
                 ("precision", self.precision, "fp32"))
        for name, value, default in named:
            if not isinstance(value, str):
                raise VarunaFxError(f"{name}={_short(value)}: give its name as a string, e.g. "
                                    f"{name}={default!r}")
        check_count("stages", self.stages, "pipeline stages")
        check_count("data_parallel", self.data_parallel, "data-parallel replicas")
        check_count("micro_batch_size", self.micro_batch_size, "samples per micro-batch")
        check_count("global_batch_size", self.global_batch_size, "samples per optimizer step")
        check_flag("recompute", self.recompute, (True, False, "auto"))
        check_flag("offload_stash", self.offload_stash)
        check_flag("shard_optimizer", self.shard_optimizer, (True, False, "auto"))
        resolve_timeout(self.timeout)  # the keyword or $VARUNA_FX_TIMEOUT: wrong values fail here
        check_precision(self.precision)  # before capture and planning, not after
        _ = self.schedule_choice  # the name resolved once, now: an unknown one is refused
        if self.tracer not in TRACERS:
            raise VarunaFxError(f"tracer={self.tracer!r} is unknown; choose one of {TRACERS}")

    @cached_property
    def schedule_choice(self) -> ScheduleChoice:
        """``schedule`` resolved into its registry entry (or "auto"): what compile hands the
        planner, so that nothing after the options decodes the name."""
        return resolve_schedule(self.schedule)


def fit_to_world(o: CompileOptions, world: int, example_batch: int,
                 settings: dict[str, Any]) -> CompileOptions:
    """The options a plan for ``world`` ranks of an in-place job uses (a morph re-plans, a
    joining process compiles, both through here, so they plan alike): the global batch of the
    running job (``settings["global_batch_size"]``, else compile's, else ``example_batch`` x D
    as planned), and ``stages`` / ``data_parallel`` only where they still fit the world (given
    for the machines a job started on, they would refuse every other count)."""
    gbs = settings.get("global_batch_size") or o.global_batch_size
    stages, dp = o.stages, o.data_parallel
    per_replica = None if stages is None else stages // (o.stages_per_rank or 1)
    if per_replica is not None and world % per_replica:
        stages = per_replica = None
    if dp is not None and (world % dp or (per_replica is not None and per_replica * dp != world)):
        dp = None
    if gbs is not None and gbs < example_batch:
        gbs = example_batch
    return dataclasses.replace(o, global_batch_size=gbs, stages=stages, data_parallel=dp)


def check_count(name: str, value: Any, what: str) -> None:
    """``value`` is None (the planner chooses) or a positive int."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise VarunaFxError(f"{name}={value!r}: give a positive number of {what}, or None to let "
                            "the planner choose")


def check_flag(name: str, value: Any, allowed: tuple[Any, ...] = (True, False)) -> None:
    if not any(value is a or (isinstance(a, str) and value == a) for a in allowed):
        raise VarunaFxError(f"{name}={value!r}: use one of {list(allowed)}")


def check_compile_arguments(model: Any, example_inputs: Any, loss_fn: Any) -> None:
    """The model is a module, example inputs are given, and ``target`` means one thing."""
    if not isinstance(model, nn.Module):
        raise VarunaFxError(f"compile expects a torch.nn.Module, got {type(model).__name__}")
    if example_inputs is None:
        raise VarunaFxError(
            "example_inputs is required: a tuple of positional args or a dict of keyword args "
            "for one sample batch (dim 0 of every tensor is the batch)"
        )
    check_target_parameter(model, loss_fn)


def check_devices(model: Any, tensors: dict[str, Any]) -> None:
    """Meta example inputs need a meta model. (A meta model with real inputs is fine: it
    plans, and step says it cannot run; the inputs' shapes are all planning reads.)"""
    params = {str(t.device) for t in [*model.parameters(), *model.buffers()]}
    inputs = {str(t.device) for t in tensors.values()}
    if "meta" in inputs and params and "meta" not in params:
        raise InputError(
            f"example_inputs are on {sorted(inputs)} but the model's parameters are on "
            f"{sorted(params)}: move both to one device (meta with meta only plans; a pipeline "
            "that runs needs real parameters and inputs)"
        )


def check_global_batch(global_batch_size: int | None, example_batch: int) -> None:
    """An example larger than the whole global batch cannot be one replica's share of it."""
    if global_batch_size is not None and example_batch > global_batch_size:
        raise InputError(
            f"example_inputs hold {example_batch} samples but global_batch_size="
            f"{global_batch_size}: a replica's batch is a share of the global batch; give an "
            f"example of at most {global_batch_size} samples or a larger global_batch_size"
        )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"<{type(value).__name__}>"


def check_target_parameter(model: Any, loss_fn: Any) -> None:
    """``pipe.step(..., target=y)`` hands ``y`` to ``loss_fn``. A forward that itself takes a
    parameter named ``target`` gets it from that keyword when there is no loss_fn (the model
    computes its loss); with a loss_fn the two meanings would be confused, so refuse."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    if loss_fn is not None and "target" in parameters:
        raise VarunaFxError(
            f"{type(model).__name__}.forward takes a parameter named 'target', but with a "
            "loss_fn, pipe.step(..., target=...) is the loss_fn's target: compute the loss in "
            "the model and pass loss_fn=None (then pipe.step(x, target=y) feeds forward's "
            "target), or wrap the model so that parameter has another name"
        )
