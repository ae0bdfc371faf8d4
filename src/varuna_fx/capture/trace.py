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

Under torch.fx, Python that needs a plain value (``assert T <= block_size``, ``*x.shape[:-1]``,
a device branch) gets the example's where it is the same at every batch size
(``shape_values.py``); a custom ``torch.autograd.Function`` stays one call with its own
backward (``autograd_functions.py``; torch.export, which would inline it, refuses it). A
``vf.deferred_init`` model is traced with its weights faked on the device its stages run on
(``trace_export.stage_device``), so its constants have values and device branches are right.

What capture refuses, keeps or fixes, so that the graph runs as eager does (fx first; what fx
refuses, ``"auto"`` then captures with torch.export):

* Grad mode: fx records none, so a ``torch.no_grad()`` block reading something that requires
  grad is refused (``grad_mode.py``); torch.export records it.
* A buffer forward rebinds (``self.steps += 1``, ``self.ema = ...``: fx proxies have no
  in-place operators) is written in place with the new value, and keeps its shape and dtype
  (``annotate_shapes`` refuses a rebinding to another one: ``NodeInfo.rebinds``); fx refuses a
  buffer rebound to a tensor it did not trace (``torch.zeros(4)``), and torch.export (2.13),
  which drops a submodule's buffer rebinding, refuses that one. Other traced values stored on
  the model are refused; tracing never leaves a proxy in the user's model.
* Code fx would silently skip is refused (``untraced.py``, ``trace_fx.capture_fx``): the
  model's own forward hooks and pre-hooks and an overridden ``__call__`` (fx traces ``forward``
  only), ``torch.autocast`` blocks; under torch.export a positional forward pre-hook on the
  model (the inputs go by keyword); under both, module backward hooks on traced code; under
  torch.export a ``tensor.register_hook`` in forward (it lands on a fake tensor).
* A tensor stored on the model in forward (``self.last = h``, not a buffer) is refused by both
  tracers (torch.export only warns: ``untraced.attribute_assignments_recorded`` makes that the
  error, except the attribute the legacy ``weight_norm``/``spectral_norm`` pre-hooks recompute).
* ``torch.utils.checkpoint(..., use_reentrant=True)`` is refused (its function runs under
  ``no_grad``); ``use_reentrant=False`` equals eager.
* Global module hooks: backward ones are refused, forward ones under fx; one added or removed
  after compile makes the next step ask for a new compile (``model_edits.py``). Forward hooks
  of traced modules, ``weight_norm``/``spectral_norm`` and ``parametrizations`` equal eager.
* A parameter written in place in forward (``w.clamp_()`` under ``no_grad``, ``w.data.mul_()``)
  is refused: micro-batches and recompute would write it again (``nn.Embedding(max_norm=...)``'s
  idempotent ``embedding_renorm_`` is allowed).
* A dict subclass forward returns (HF ``ModelOutput``) comes back as itself under fx too
  (``trace_fx``'s ``create_arg``). Example inputs that share memory (``labels=input_ids``) are
  exported as copies (torch.export reads one tensor passed twice through one placeholder).
  torch.export's ``_assert_tensor_metadata`` checks are dropped with its input guards (under
  autocast the dtype differs, as in eager).
* Each node's ``stack_trace`` (user frames only) is recorded by our tracer, not fx's
  ``record_stack_traces``, whose frame filter imports torch._dynamo/_inductor/export (a
  fresh process pays for it: bench/RESULTS.md, "Figures the code cites").
"""

from __future__ import annotations

import inspect

import torch
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
    drop_pipe_splits,
    pipe_splits_recorded,
    reentrant_checkpoints_recorded,
    refuse_reentrant_checkpoint,
)

TRACERS = ("fx", "export", "auto")


def capture(model: nn.Module, bound: BoundInputs, tracer: str = "auto") -> Captured:
    refuse_tensor_defaults(model, bound)
    with settings_kept(model), reentrant_checkpoints_recorded() as reentrant, \
            pipe_splits_recorded() as splits:
        try:
            captured = _capture(model, bound, tracer)
        except CaptureError:
            if not reentrant:
                raise
    if reentrant:
        refuse_reentrant_checkpoint(model, reentrant[0])
    drop_pipe_splits(model, captured.gm, splits)
    return captured


def refuse_tensor_defaults(model: nn.Module, bound: BoundInputs) -> None:
    """A forward parameter left at a tensor default is a constant of the graph, as
    torch.distributed.pipelining runs it (``y=torch.ones(64)``), unless its dim 0 is the
    example's batch size (``y=torch.zeros(16, 64)`` with a batch of 16): added to a smaller
    micro-batch it would not broadcast (or broadcast wrongly), and whether it is per sample is
    not for us to guess, so say what to do instead."""
    batch = bound.batch_size
    for name, param in inspect.signature(model.forward).parameters.items():
        default = param.default
        if isinstance(default, torch.Tensor) and name not in bound.tensors and \
                default.dim() > 0 and default.shape[0] == batch:
            raise CaptureError(
                f"{type(model).__name__}.forward's parameter '{name}' defaults to a tensor "
                f"(shape {tuple(default.shape)}){defined_at(model)} whose dim 0 is the batch "
                f"size ({batch}), and the example inputs leave it out: a pipeline splits the "
                "batch into micro-batches, which a constant of the whole batch's rows does not "
                f"fit. Pass '{name}' in example_inputs and at every step (with the batch on dim "
                f"0), or make it a buffer (self.register_buffer('{name}', ...)) that forward "
                "reads (a default whose dim 0 is not the batch is kept as a constant)")


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
