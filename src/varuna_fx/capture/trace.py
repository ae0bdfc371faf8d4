"""Capture: an unmodified ``nn.Module`` becomes one flat ``fx.GraphModule``.

Whatever tracer is used, the result has the same canonical shape, so every later pass sees one
kind of graph:

* one placeholder per tensor input, named after the ``forward`` parameter it binds to;
* ``get_attr`` / ``call_module`` targets are the original fully qualified names (FQNs), and the
  parameters are the model's own ``Parameter`` objects (gradients land on the user's model);
* the output node returns a flat tuple of leaves; ``out_spec`` rebuilds the user's structure
  (a tensor, tuple, dict or HuggingFace ``ModelOutput``).

Tracers: ``"fx"`` is ``torch.fx`` symbolic tracing (keeps ``nn.Linear`` etc. as readable
``call_module`` nodes); ``"export"`` is non-strict ``torch.export`` (aten-level, for models fx
cannot trace such as every HuggingFace transformers 5.x model); ``"auto"`` tries fx, then export.
"""

from __future__ import annotations

import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from ..errors import CaptureError
from .captured import Captured
from .failures import defined_at
from .inputs import BoundInputs
from .model_edits import settings_kept
from .trace_export import capture_export
from .trace_fx import capture_fx
from .untraced import (
    check_global_hooks,
    check_hooks,
    check_parameter_writes,
    reentrant_checkpoints_recorded,
    refuse_reentrant_checkpoint,
)

TRACERS = ("fx", "export", "auto")


def capture(model: nn.Module, bound: BoundInputs, tracer: str = "auto") -> Captured:
    with settings_kept(model), reentrant_checkpoints_recorded() as reentrant:
        try:
            captured = _capture(model, bound, tracer)
        except CaptureError:
            if not reentrant:
                raise
    if reentrant:
        refuse_reentrant_checkpoint(model, reentrant[0])
    return captured


def _capture(model: nn.Module, bound: BoundInputs, tracer: str) -> Captured:
    if tracer not in TRACERS:
        raise CaptureError(f"tracer={tracer!r} is unknown; use one of {TRACERS}")
    if tracer == "fx":
        return _check_output(model, _checked(model, capture_fx(model, bound)))
    if tracer == "export":
        return _check_output(model, _checked(model, capture_export(model, bound)))
    try:
        captured = _checked(model, capture_fx(model, bound, alone=False))
    except CaptureError as fx_error:
        try:
            captured = _checked(model, capture_export(model, bound, alone=False))
        except CaptureError as export_error:
            raise CaptureError(
                f"neither tracer could capture {type(model).__name__}.\n"
                f"  fx: {fx_error}\n  export: {export_error}"
            ) from None
    return _check_output(model, captured)


def _checked(model: nn.Module, captured: Captured) -> Captured:
    """What either tracer captured, refused if it would silently differ from eager."""
    check_hooks(model, captured.gm, captured.tracer)
    check_global_hooks(captured.tracer)
    check_parameter_writes(model, captured.gm)
    return captured


def _check_output(model: nn.Module, captured: Captured) -> Captured:
    """A forward whose output holds no tensor computed from the inputs has nothing to train."""
    output = next(n for n in reversed(captured.gm.graph.nodes) if n.op == "output")
    if not any(isinstance(leaf, fx.Node) for leaf in output.args[0]):
        values = pytree.tree_unflatten(list(output.args[0]), captured.out_spec)
        raise CaptureError(
            f"{type(model).__name__}.forward returned {values!r}, which holds no tensor computed "
            f"from the inputs{defined_at(model)}: return the loss, or the output that loss_fn "
            "takes (a tensor, or a tuple/dict/dataclass of tensors)"
        )
    return captured
