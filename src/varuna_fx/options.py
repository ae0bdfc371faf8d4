"""``vf.compile``'s options: one frozen object, checked once, before any work is done.

:class:`CompileOptions` holds every keyword ``vf.compile`` takes besides the model and its
example inputs (the torchtitan way: a frozen options object rather than arguments passed
along one by one). It is two parts and the tracer: the planning part
(``planner/options.PlanOptions``, taken whole by the planner) and the running part
(``runtime/options.RunOptions``, taken whole by ``make_pipeline``, the ``Pipeline`` and both
runtimes); ``.planning`` and ``.running`` hand each its own. Making one checks all of them, each
error saying which option is wrong and what to pass instead; the rest of ``compile`` reads the
checked object.

A new option is added in two places: a field of the part that reads it (with its check) and a
keyword of ``vf.compile`` (``tests/api/test_options.py`` holds the two equal).

What depends on the model or its bound inputs (the model's type, example inputs given, their
devices, a ``target`` parameter) is checked here too, by the functions below, once compile has
them.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

from .capture.trace import TRACERS
from .errors import InputError, PlanError, VarunaFxError
from .planner.options import PlanOptions, check_name
from .runtime.options import RunOptions

_Part = TypeVar("_Part", PlanOptions, RunOptions)


@dataclass(frozen=True)
class CompileOptions(PlanOptions, RunOptions):
    """The options of one ``vf.compile`` call (docs/API.md has their meaning), valid once
    made: the fields of both parts (``timeout``, ``shard_optimizer`` and ``global_batch_size``
    are read by both) and the tracer."""

    tracer: str = "auto"

    def __post_init__(self) -> None:
        PlanOptions.__post_init__(self)
        RunOptions.__post_init__(self)
        check_name("tracer", self.tracer, "auto")
        if self.tracer not in TRACERS:
            raise VarunaFxError(f"tracer={self.tracer!r} is unknown; choose one of {TRACERS}")

    @property
    def planning(self) -> PlanOptions:
        """What the planner reads."""
        return self._part(PlanOptions)

    @property
    def running(self) -> RunOptions:
        """What the pipeline and its runtimes read."""
        return self._part(RunOptions)

    def _part(self, cls: type[_Part]) -> _Part:
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})


def fit_to_world(o: CompileOptions, world: int, example_batch: int,
                 settings: dict[str, Any]) -> CompileOptions:
    """The options a plan for ``world`` ranks of an in-place job uses (a morph re-plans, a
    joining process compiles, both through here, so they plan alike): the global batch of the
    running job (``settings["global_batch_size"]``, else compile's), and ``stages`` /
    ``data_parallel`` only where they still fit the world (given for the machines a job
    started on, they would refuse every other count)."""
    refuse_stateful_sync(o.replica_sync)
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


# what an in-place job's replicas may sync with: settings that keep no state across steps
IN_PLACE_SYNCS = ("exact", "bf16")


def refuse_stateful_sync(replica_sync: Any) -> None:
    """An in-place morph moves weights, optimizer state and the data position, not a replica
    sync's own state (PowerSGD's error feedback and warm-start factors, DiLoCo's anchor and
    outer optimizer), so an in-place job refuses those settings, and "auto" (which may choose
    PowerSGD), rather than train on after a morph with that state lost or misplaced."""
    if isinstance(replica_sync, str) and replica_sync in IN_PLACE_SYNCS:
        return
    shown = repr(replica_sync) if isinstance(replica_sync, str) else f"vf.{replica_sync!r}"
    raise PlanError(
        f"replica_sync={shown} cannot run in an in-place job (varuna-fx run --elastic "
        "--in-place): it keeps state across steps on each replica (PowerSGD's error feedback, "
        "DiLoCo's anchor and outer optimizer; 'auto' may choose PowerSGD), which a morph does "
        "not move. Compile with replica_sync='exact' or 'bf16', or run without --in-place "
        "(the restart path checkpoints that state)")


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
