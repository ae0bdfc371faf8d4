"""Code and state around ``forward`` that a captured graph would silently lose, found at
capture: refused with an error naming it and what to do, or marked for a later check.

* Hooks: a module the graph calls (``call_module``) runs all its hooks at each step; one
  traced into the graph ran its forward hooks while traced, but not its backward hooks;
  torch.fx traces the model's own ``forward`` without ``__call__`` (so without its hooks);
  torch.export passes the inputs by keyword (a positional forward pre-hook sees none) and
  registers a ``tensor.register_hook`` in forward on a fake tensor.
* State: a parameter written in place in forward would be written again per micro-batch and
  recompute; a buffer forward rebinds is written in place by its stage, which torch.export
  (2.13) leaves out for a submodule's buffer, and which must keep its shape and dtype
  (``NodeInfo.rebinds``, checked by ``annotate_shapes``).

Not refused but per micro-batch: a parameter hook (``p.register_hook``) runs once per
micro-batch on that micro-batch's gradient, so a non-linear one (clipping each gradient)
differs from eager on the whole batch; a ``torch.autocast`` block computes per micro-batch in
low precision, so its gradients differ from eager's within that precision.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from ..errors import CaptureError
from ..ir.nodes import info as node_info
from . import autograd_functions
from .buffers import written_parameters
from .model_edits import traced_modules


def check_hooks(model: nn.Module, gm: fx.GraphModule, tracer: str) -> None:
    """Hooks the graph would silently drop are refused. A module the graph calls
    (``call_module``) runs all its hooks at each step; one traced into the graph ran its
    forward hooks while traced (they are in the graph), but its backward hooks act on autograd
    nodes that tracing never makes; torch.fx traces the model's own ``forward`` without
    ``__call__``, so the model's forward hooks never ran (torch.export's pre-hook case is
    :func:`check_root_pre_hooks`)."""
    traced = traced_modules(gm)
    for path, module in model.named_modules():
        if path not in traced:
            continue
        where = f"{type(model).__name__}{'.' + path if path else ''}"
        for kind, hooks in (("hook", module._backward_hooks),
                            ("pre-hook", module._backward_pre_hooks)):
            for hook in hooks.values():
                raise CaptureError(
                    f"{where} ({type(module).__name__}) has the backward {kind} "
                    f"{_hook_name(hook)}, and its code is traced into the graph, where module "
                    "backward hooks do not run: the pipeline would silently skip it. Remove it, "
                    "or hook its parameters instead (parameter.register_hook)")
        if path or tracer != "fx":
            continue
        for kind, hooks in (("pre-hook", module._forward_pre_hooks),
                            ("hook", module._forward_hooks)):
            for key, hook in hooks.items():
                exported = kind == "hook" or key in module._forward_pre_hooks_with_kwargs
                raise CaptureError(
                    f"{where} has the forward {kind} {_hook_name(hook)}: torch.fx traces the "
                    "model's forward without its hooks, so the pipeline would silently skip it. "
                    f"{_hook_advice(hook)}Register it on a submodule or apply it in forward"
                    + (", or use tracer='export' (or 'auto')" if exported else ""))


def check_global_hooks(tracer: str) -> None:
    """Hooks registered for every module run on every module in eager; traced code runs no
    module backward hooks, and torch.fx calls the model's own forward without ``__call__``,
    so the model itself would skip global forward hooks."""
    module = torch.nn.modules.module
    backward = ("module backward hooks do not run on code traced into the graph, so the "
                "pipeline would silently skip it for most modules. Remove it before vf.compile, "
                "or hook the parameters instead (parameter.register_hook)")
    forward = ("torch.fx traces the model's forward without its hooks, so the pipeline would "
               "silently skip it for the model itself. Use tracer='export' (or 'auto'), or "
               "remove it before vf.compile")
    refused = [("backward pre-hook", module._global_backward_pre_hooks, backward),
               ("backward hook", module._global_backward_hooks, backward)]
    if tracer == "fx":
        refused += [("forward pre-hook", module._global_forward_pre_hooks, forward),
                    ("forward hook", module._global_forward_hooks, forward)]
    for kind, hooks, why in refused:
        for hook in hooks.values():
            raise CaptureError(
                f"the global module {kind} {_hook_name(hook)} is registered (torch.nn.modules."
                f"module.register_module_*hook): {why}")


def check_root_pre_hooks(model: nn.Module, alone: bool) -> None:
    """torch.export gets the inputs by keyword: a forward pre-hook of the model itself would
    see no positional arguments (and fail, or act on none)."""
    for key, hook in model._forward_pre_hooks.items():
        if key not in model._forward_pre_hooks_with_kwargs:
            raise CaptureError(
                f"{type(model).__name__} has the forward pre-hook {_hook_name(hook)}: with "
                "torch.export the pipeline passes the model's inputs by keyword, so it would "
                f"see no positional arguments. {_hook_advice(hook)}Register it with "
                "with_kwargs=True or on a submodule, or apply it in forward"
                + (" (or use tracer='fx')" if alone else ""))


def check_parameter_writes(model: nn.Module, gm: fx.GraphModule) -> None:
    """A parameter written in place in forward (``w.clamp_()`` under torch.no_grad(),
    ``w.data.mul_(0.9)``) is written again by every micro-batch and every recompute, and the
    graph's later reads of it read the write, which carries no gradient: refused.
    ``embedding_renorm_`` (``nn.Embedding(max_norm=...)``) gives the same weights however
    often it runs."""
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.embedding_renorm_.default:
            continue
        for name in written_parameters(node):
            where = " ".join(x.strip() for x in node.stack_trace.splitlines()[-2:]) \
                if node.stack_trace else ""
            raise CaptureError(
                f"{type(model).__name__}.forward writes the parameter {name} in place"
                f"{' (' + where + ')' if where else ''}: a pipeline runs forward once per "
                "micro-batch and again to recompute, so it would be written more often than "
                "in eager, and later reads of it would not carry its gradient. Write it "
                "outside forward, after optimizer.step() (with torch.no_grad(): "
                f"model.{name}.clamp_(...))")


def _hook_advice(hook: Any) -> str:
    if type(hook).__name__ in ("WeightNorm", "SpectralNorm"):
        return ("torch.nn.utils.weight_norm/spectral_norm work by such a hook: use "
                "torch.nn.utils.parametrizations.weight_norm/spectral_norm instead. ")
    return ""


def _hook_name(hook: Any) -> str:
    """A hook's name and where it is defined, as far as known."""
    function = getattr(hook, "__func__", hook)
    name = getattr(function, "__qualname__", None) or type(hook).__qualname__
    code = getattr(function, "__code__", None)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code else name


@contextlib.contextmanager
def rebinding_recorded(model: nn.Module) -> Iterator[list[str]]:
    """The FQNs of the buffers forward rebinds while torch.export traces it (``self.ema =
    ...``): assignments of a fake tensor to a registered buffer (export's own swaps of real
    tensors are not forward's)."""
    paths = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    found: list[str] = []

    def record(module: nn.Module, name: str, value: Any) -> None:
        if isinstance(value, (FakeTensor, FunctionalTensor)) and id(module) in paths \
                and name in module._buffers:
            found.append(f"{paths[id(module)]}.{name}".lstrip("."))

    hook = torch.nn.modules.module.register_module_buffer_registration_hook(record)
    try:
        yield found
    finally:
        hook.remove()


@contextlib.contextmanager
def _calls_recorded(owner: type, name: str) -> Iterator[list[str]]:
    """Where (file:line, the model's code) ``owner.name`` is called while the body runs: the
    function is wrapped for that long, then put back as it was."""
    found: list[str] = []
    original = owner.__dict__[name]
    function = original.__func__ if isinstance(original, staticmethod) else original

    def recording(*args: Any, **kwargs: Any) -> Any:
        found.append(_first_frame_outside_torch())
        return function(*args, **kwargs)

    setattr(owner, name, staticmethod(recording) if isinstance(original, staticmethod)
            else recording)
    try:
        yield found
    finally:
        setattr(owner, name, original)


def tensor_hooks_recorded() -> contextlib.AbstractContextManager[list[str]]:
    """Where forward calls ``tensor.register_hook`` while torch.export traces it: on a fake
    tensor, so the hook is in no graph."""
    return _calls_recorded(torch.Tensor, "register_hook")


def reentrant_checkpoints_recorded() -> contextlib.AbstractContextManager[list[str]]:
    """Where forward runs ``torch.utils.checkpoint(..., use_reentrant=True)`` (HuggingFace's
    ``gradient_checkpointing_enable()`` default in many versions) while either tracer traces
    it: its function runs under torch.no_grad() and only a reentrant backward would give its
    parameters their gradients, so torch.export records a block without gradients (and
    torch.fx refuses the no_grad block)."""
    from torch.utils.checkpoint import CheckpointFunction

    return _calls_recorded(CheckpointFunction, "forward")


def refuse_reentrant_checkpoint(model: nn.Module, where: str) -> None:
    """Whatever either tracer made of a reentrant checkpoint, the gradients would be wrong."""
    raise CaptureError(
        f"{type(model).__name__}.forward uses torch.utils.checkpoint with use_reentrant=True "
        f"({where}): traced, its function runs under torch.no_grad(), so its parameters would "
        "silently get no gradient. Drop it -- varuna_fx recomputes activations itself "
        "(recompute=True or 'auto'); for a HuggingFace model call "
        "model.gradient_checkpointing_disable() -- or pass use_reentrant=False")


def _first_frame_outside_torch() -> str:
    """file:line of the innermost caller that is not torch's own code (the model's call)."""
    torch_dir = os.path.dirname(torch.__file__)
    frame = sys._getframe(1)
    ours = (__file__, autograd_functions.__file__)  # the Function.apply patched while tracing
    while frame.f_back is not None and (frame.f_code.co_filename.startswith(torch_dir)
                                        or frame.f_code.co_filename in ours):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


_ASSIGNED = re.compile(r"The tensor attributes? (.+) (?:was|were) assigned during export")


@contextlib.contextmanager
def attribute_assignments_recorded() -> Iterator[list[str]]:
    """The tensor attributes forward sets while torch.export traces it (``self.last_hidden =
    h``, not a registered buffer): torch.export restores the model's attributes afterwards and
    only warns, so after a pipeline step they would silently not be set. Found from that
    warning (torch's own before/after comparison of every module's attributes); every other
    warning is passed on."""
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        # every time, not once per place: a second compile of the model must see it too
        warnings.filterwarnings("always", message=".*assigned during export")
        yield found
    for warning in caught:
        match = _ASSIGNED.search(str(warning.message))
        if match:
            found.extend(name.strip() for name in match.group(1).split(","))
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename,
                                   warning.lineno, source=warning.source)


def recomputed_by_hooks(model: nn.Module) -> set[str]:
    """Attributes the legacy ``weight_norm``/``spectral_norm`` forward pre-hooks set before
    each call (``self.lin.weight``, from ``weight_g``/``weight_v``): the graph computes them
    where the module reads them, and the next forward sets them again."""
    return {f"self.{path + '.' if path else ''}{hook.name}"
            for path, module in model.named_modules()
            for hook in module._forward_pre_hooks.values()
            if type(hook).__name__ in ("WeightNorm", "SpectralNorm")}


def mark_rebinds(model: nn.Module, gm: fx.GraphModule, rebound: list[str],
                  alone: bool) -> None:
    """Mark the write-back of each buffer forward rebinds: torch.export writes it with
    ``copy_`` after the whole graph, a write annotate_shapes checks to keep the buffer's shape
    and dtype. torch.export (2.13) writes back only the root module's buffers: a submodule's
    rebinding (``self.block.ema = ...``) vanished from its graph, so it is refused."""
    last_writes = {}
    for node in gm.graph.nodes:  # the write-back is the buffer's last write
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default \
                and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr":
            last_writes[str(node.args[0].target)] = node
    for fqn in dict.fromkeys(rebound):
        if fqn not in last_writes:
            owner, _, key = fqn.rpartition(".")
            raise CaptureError(
                f"{type(model).__name__}.{fqn} is a buffer that forward rebinds "
                f"(self.{key} = ... in {type(model.get_submodule(owner)).__name__}.forward): "
                "torch.export drops that assignment for a submodule's buffer, so the pipeline "
                f"would never update it. Write it in place (self.{key}.copy_(new_value))"
                + (" or use tracer='fx'" if alone else ""))
        node_info(last_writes[fqn]).rebinds = fqn


class PipeSplitIgnoredWarning(UserWarning):
    """torch.distributed.pipelining's ``pipe_split()`` markers in forward: varuna_fx cuts
    where the costs say and leaves them out."""


@contextlib.contextmanager
def pipe_splits_recorded() -> Iterator[list[str]]:
    """Where forward calls torch.distributed.pipelining's ``pipe_split()`` while the body runs.
    fx records no node for it (it takes no tensor), so its op is wrapped for that long, as
    ``_calls_recorded`` does for methods; nothing when the op is not registered (the model
    cannot call it then)."""
    found: list[str] = []
    try:
        namespace = torch.ops.pippy
        original = namespace._pipe_split
    except (AttributeError, RuntimeError):
        yield found
        return

    class Recording:  # the op, recording its calls (torch.export reads its overloads)
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            found.append(_first_frame_outside_torch())
            return original(*args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(original, name)

    namespace._pipe_split = Recording()
    try:
        yield found
    finally:
        namespace._pipe_split = original


def drop_pipe_splits(model: nn.Module, gm: fx.GraphModule, found: list[str]) -> None:
    """Erase the ``pipe_split()`` markers torch.export records (a no-op call) and say that
    they are ignored: the partition chooses cuts by cost, ``stages=`` chooses how many."""
    markers = [n for n in gm.graph.nodes if n.op == "call_function"
               and "pippy._pipe_split" in str(n.target)]
    for node in markers:
        gm.graph.erase_node(node)
    if markers:
        gm.recompile()
    if not found and not markers:
        return
    where = f" at {found[0]}" if found and found[0] else ""
    warnings.warn(
        f"{type(model).__name__}.forward calls torch.distributed.pipelining.pipe_split()"
        f"{where}: varuna_fx ignores these markers and cuts the model where its costs balance "
        "the stages; choose the depth with vf.compile(..., stages=P)",
        PipeSplitIgnoredWarning, stacklevel=4)
