"""Checking ``vf.compile``'s scalar arguments before any work is done.

Each check says which argument is wrong and what to pass instead. ``bool`` is refused where a
count is expected: ``True`` is an ``int`` in Python, and ``stages=True`` meaning one stage is
never what the user meant.
"""

from __future__ import annotations

from typing import Any

from .errors import InputError, VarunaFxError
from .planner.cluster import Cluster
from .runtime.precision import check_precision
from .world.where import resolve_timeout


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


def check_compile_arguments(*, stages: Any, data_parallel: Any, micro_batch_size: Any,
                            global_batch_size: Any, recompute: Any, offload_stash: Any,
                            timeout: Any, precision: Any = "fp32", cluster: Any = None,
                            loss_fn: Any = None, schedule: Any = "auto",
                            tracer: Any = "auto", shard_optimizer: Any = "auto") -> None:
    if cluster is not None and not isinstance(cluster, Cluster):
        raise VarunaFxError(
            f"cluster={_short(cluster)} is not a vf.Cluster: the second positional argument of "
            "vf.compile is the cluster; pass the inputs as example_inputs=(...)"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise VarunaFxError(f"loss_fn={_short(loss_fn)} is not callable: pass a function "
                            "loss_fn(output, target) -> 0-d tensor, or None")
    named = (("schedule", schedule, "varuna"), ("tracer", tracer, "auto"),
             ("precision", precision, "fp32"))
    for name, value, default in named:
        if not isinstance(value, str):
            raise VarunaFxError(f"{name}={_short(value)}: give its name as a string, e.g. "
                                f"{name}={default!r}")

    check_count("stages", stages, "pipeline stages")
    check_count("data_parallel", data_parallel, "data-parallel replicas")
    check_count("micro_batch_size", micro_batch_size, "samples per micro-batch")
    check_count("global_batch_size", global_batch_size, "samples per optimizer step")
    check_flag("recompute", recompute, (True, False, "auto"))
    check_flag("offload_stash", offload_stash)
    check_flag("shard_optimizer", shard_optimizer, (True, False, "auto"))
    resolve_timeout(timeout)  # the keyword or $VARUNA_FX_TIMEOUT: wrong values fail here
    check_precision(precision)  # before capture and planning, not after


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
    import inspect

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
