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

import collections
import inspect
import linecache
import os
import re
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.immutable_collections import immutable_dict, immutable_list

from ..errors import CaptureError, InputError
from ..ir.nodes import info as node_info
from .grad_mode import check_no_grad_blocks
from .model_edits import settings_kept
from .mutations import keep_mutations, place_write_backs
from .untraced import (
    attribute_assignments_recorded,
    check_global_hooks,
    check_hooks,
    check_parameter_writes,
    check_root_pre_hooks,
    mark_rebinds,
    rebinding_recorded,
    recomputed_by_hooks,
    reentrant_checkpoints_recorded,
    refuse_reentrant_checkpoint,
    tensor_hooks_recorded,
)

TRACERS = ("fx", "export", "auto")


@dataclass
class BoundInputs:
    """The user's example inputs bound to ``model.forward``'s parameters."""

    tensors: dict[str, torch.Tensor]  # graph inputs, in signature order
    constants: dict[str, Any] = field(default_factory=dict)  # non-tensor values given by the user

    @property
    def batch_size(self) -> int:
        return next(iter(self.tensors.values())).shape[0]


@dataclass
class Captured:
    gm: fx.GraphModule
    input_names: list[str]
    out_spec: pytree.TreeSpec
    tracer: str
    signature: inspect.Signature
    constants: dict[str, Any]


def bind_inputs(model: nn.Module, inputs: Any, kw_inputs: dict[str, Any] | None = None,
                *, what: str = "example_inputs",
                signature: inspect.Signature | None = None) -> BoundInputs:
    """Bind positional/keyword inputs to ``model.forward`` and check the batch dimension."""
    if isinstance(inputs, torch.Tensor):
        args, kwargs = (inputs,), {}
    elif isinstance(inputs, dict):
        args, kwargs = (), dict(inputs)
    elif isinstance(inputs, (tuple, list)):
        args, kwargs = tuple(inputs), {}
    else:
        raise InputError(
            f"{what} must be a tuple of positional arguments or a dict of keyword arguments "
            f"for {type(model).__name__}.forward, got {type(inputs).__name__}"
        )
    kwargs.update(kw_inputs or {})
    # every step binds its inputs: callers that already have the signature pass it
    signature = signature or inspect.signature(model.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise InputError(
            f"{what} do not match {type(model).__name__}.forward{signature}: {exc}"
        ) from None
    tensors: dict[str, torch.Tensor] = {}
    constants: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise InputError(
                f"{type(model).__name__}.forward takes *args/**kwargs ('{name}'); pass inputs "
                "that bind to named parameters, or wrap the model in a module with explicit ones"
            )
        if isinstance(value, torch.Tensor):
            tensors[name] = value
        elif value is None or isinstance(value, (bool, int, float, str)):
            constants[name] = value
        else:
            raise InputError(
                f"{what}: argument '{name}' is a {type(value).__name__}; inputs must be tensors "
                "(with the batch on dim 0) or plain constants (None, bool, int, float, str)"
            )
    if not tensors:
        raise InputError(f"{what} contain no tensor: give at least one batch tensor")
    batch = {n: (t.shape[0] if t.dim() > 0 else None) for n, t in tensors.items()}
    if None in batch.values():
        scalars = [n for n, b in batch.items() if b is None]
        raise InputError(
            f"{what}: {scalars} are 0-d tensors; every tensor input needs the batch on dim 0"
        )
    if len(set(batch.values())) > 1:
        sizes = ", ".join(f"{n}: {b}" for n, b in batch.items())
        raise InputError(
            f"{what}: tensors disagree on the batch size (dim 0): {sizes}; dim 0 of every "
            "tensor input must be the batch"
        )
    if 0 in batch.values():
        raise InputError(
            f"{what}: the batch (dim 0) is empty; give at least one sample"
        )
    return BoundInputs(tensors, constants)


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
        return _check_output(model, _checked(model, _capture_fx(model, bound)))
    if tracer == "export":
        return _check_output(model, _checked(model, _capture_export(model, bound)))
    try:
        captured = _checked(model, _capture_fx(model, bound, alone=False))
    except CaptureError as fx_error:
        try:
            captured = _checked(model, _capture_export(model, bound, alone=False))
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
            f"from the inputs{_defined_at(model)}: return the loss, or the output that loss_fn "
            "takes (a tensor, or a tuple/dict/dataclass of tensors)"
        )
    return captured


# -- fx ------------------------------------------------------------------------------------------


class _Tracer(fx.Tracer):
    # Each node keeps its source lines (error messages and the generated stage code show them),
    # but not through fx's own ``record_stack_traces``: in torch 2.13 that symbolizes frames
    # with the profiler and filters them with ``symbolic_shapes.uninteresting_files()``, whose
    # first call imports torch._dynamo, torch._inductor and torch.export (~2 s of CPU, most of
    # a restarted job's compile) -- and it still kept fx's own frames. See ``create_node``.
    record_stack_traces = False
    # Buffers (causal masks, rotary tables) become get_attr nodes instead of baked constants,
    # so they may be sliced by traced sizes and are owned by the stages that read them.
    proxy_buffer_attributes = True

    def __init__(self) -> None:
        super().__init__()
        # nodes made under torch.no_grad() in forward (fx records no grad mode: capture/grad_mode.py)
        self.no_grad_nodes: set[fx.Node] = set()
        self.typed_dicts: list[dict] = []  # see create_arg
        # the first node made inside a torch.autocast block in forward (fx records none)
        self.autocast_start = _autocast_state()
        self.autocast_node: fx.Node | None = None

    def create_arg(self, a: Any) -> Any:
        # fx stores a dict subclass (a HuggingFace ModelOutput dataclass) as a plain dict:
        # keep the object, so the pipeline returns the type forward does (_flatten_output)
        if isinstance(a, dict) and type(a) not in _PLAIN_DICTS \
                and type(a) in pytree.SUPPORTED_NODES:
            self.typed_dicts.append(a)
        return super().create_arg(a)

    def create_node(self, kind: str, target: Any, args: Any, kwargs: Any,
                    name: str | None = None, type_expr: Any = None) -> fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if not node.stack_trace:
            node.stack_trace = _user_stack_trace()
        if not torch.is_grad_enabled():
            self.no_grad_nodes.add(node)
        if self.autocast_node is None and _autocast_state() != self.autocast_start:
            self.autocast_node = node
        return node


def _autocast_state() -> tuple:
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                 for d in ("cpu", "cuda"))


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _user_stack_trace() -> str:
    """The traceback from the outermost ``forward`` down to the user's line that made the node,
    without torch's frames (fx's proxy machinery, ``nn.Module.__call__``)."""
    frames = []
    frame = sys._getframe(2)  # the caller of create_node
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    frames.reverse()
    start = next((i for i, f in enumerate(frames) if f[2] == "forward"), None)
    if start is None:  # not inside a forward: nothing useful to point at
        return ""
    kept = [traceback.FrameSummary(file, line, name) for file, line, name in frames[start:]
            if not file.startswith(_TORCH_DIR)]
    return "".join(traceback.StackSummary.from_list(kept).format()).strip()


def _capture_fx(model: nn.Module, bound: BoundInputs, alone: bool = True) -> Captured:
    signature = inspect.signature(model.forward)
    concrete = dict(bound.constants)
    for name, param in signature.parameters.items():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if name not in bound.tensors and name not in concrete:
            if param.default is inspect.Parameter.empty:
                raise InputError(f"example_inputs give no value for '{name}'")
            concrete[name] = param.default
    tracer = _Tracer()
    before = _module_attributes(model)
    try:
        # grad mode as in training (compile may be called under no_grad); forward's own
        # no_grad blocks show in tracer.no_grad_nodes
        with torch.enable_grad():
            graph = tracer.trace(model, concrete_args=concrete or None)
    except Exception as exc:  # fx raises many kinds: TraceError, TypeError, AttributeError...
        raise CaptureError(_describe_failure("torch.fx", exc, model, alone)) from None
    finally:
        assigned = _restore_proxy_attributes(model, before)
    _write_assigned_buffers(model, graph, assigned, alone)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    _drop_concrete_placeholders(gm, bound)
    keep_mutations(gm)  # dead-code elimination that keeps `y.relu_()` statements
    check_no_grad_blocks(gm, tracer.no_grad_nodes, alone)
    if tracer.autocast_node is not None:
        where = " ".join(x.strip() for x in tracer.autocast_node.stack_trace.splitlines()[-2:])
        raise CaptureError(
            f"{type(model).__name__}.forward runs operations in a torch.autocast block"
            f"{' (' + where + ')' if where else ''}: torch.fx does not record autocast, so the "
            "pipeline would run them in full precision. Use tracer='export'"
            + (" or 'auto'" if alone else "") + ", or vf.compile(..., precision='bf16'/'fp16') "
            "for the whole model")
    if type(model).__call__ is not nn.Module.__call__:
        raise CaptureError(
            f"{type(model).__name__} overrides __call__{_defined_at(model, '__call__')}: "
            "torch.fx traces "
            "forward only, so what __call__ adds would be skipped. Move it into forward"
            + (", or use tracer='export' or 'auto'" if alone else ""))
    out_spec = _flatten_output(gm, tracer.typed_dicts[-1:])
    return Captured(gm, list(bound.tensors), out_spec, "fx", signature, bound.constants)


_Attributes = list[tuple[str, dict[str, Any], dict[str, Any]]]


def _module_attributes(model: nn.Module) -> _Attributes:
    """Every module's attribute dicts (own, parameters, buffers, submodules), copied."""
    return [(name, d, dict(d)) for name, m in model.named_modules(remove_duplicate=False)
            for d in (m.__dict__, m._parameters, m._buffers, m._modules)]


def _restore_proxy_attributes(model: nn.Module, before: _Attributes
                              ) -> list[tuple[str, str, fx.Proxy | Any]]:
    """Undo what tracing assigned into the model that holds an fx value (``self.steps += 1``
    on a buffer, ``self.last = h``): fx's proxies have no in-place operators, so forward
    rebinds the attribute to a proxy, which left the user's model holding graph objects.
    Returns (module path, attribute, assigned value) for each such assignment."""
    assigned = []
    for path, now, then in before:
        buffers = now is model.get_submodule(path)._buffers
        # a traced value, or (a buffer rebound to) a tensor fx did not trace (torch.zeros(4))
        changed = [k for k, v in now.items() if then.get(k, _MISSING) is not v
                   and (any(isinstance(x, fx.Proxy) for x in pytree.tree_leaves(v))
                        or (buffers and k in then and isinstance(v, torch.Tensor)))]
        for key in changed:
            assigned.append((path, key, now[key]))
            if key in then:
                now[key] = then[key]
            else:
                del now[key]
    return assigned


_MISSING = object()


def _write_assigned_buffers(model: nn.Module, graph: fx.Graph,
                            assigned: list[tuple[str, str, Any]], alone: bool) -> None:
    """A buffer rebound in forward (``self.ema = 0.9 * self.ema + ...``, or ``+=``, which is
    in place in eager) is written in place with the new value, where forward assigned it;
    reads after the assignment already read the new value. Any other attribute that forward
    sets to a traced value cannot be kept by a graph."""
    for path, key, value in assigned:
        owner = model.get_submodule(path)
        fqn = f"{path}.{key}" if path else key
        if key in owner._buffers and isinstance(value, fx.Proxy):
            with graph.inserting_after(value.node):
                buffer = graph.get_attr(fqn)
            with graph.inserting_after(buffer):
                write = graph.call_method("copy_", (buffer, value.node))
            node_info(write).rebinds = fqn  # annotate_shapes checks its shape and dtype
            write.stack_trace = value.node.stack_trace
            continue
        if key in owner._buffers and isinstance(value, torch.Tensor):
            raise CaptureError(
                f"{type(model).__name__}.forward rebinds buffer self.{fqn} to a tensor that does "
                f"not depend on the inputs or the model{_defined_at(model)}: torch.fx does not "
                f"trace making it (torch.zeros(...) and the like), so the graph cannot write it. "
                f"Write it in place (self.{key}.zero_(), self.{key}.copy_(...))"
                + (" or try tracer='export'" if alone else ""))
        raise CaptureError(
            f"{type(model).__name__}.forward assigns a traced value to self.{fqn}"
            f"{_defined_at(model)}: torch.fx cannot keep tensors stored on the model. Register "
            "it as a buffer (register_buffer) and update it in place, or return it")


def _drop_concrete_placeholders(gm: fx.GraphModule, bound: BoundInputs) -> None:
    """fx keeps a placeholder for each concrete arg, feeding only a guard: remove both."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "placeholder" or node.target in bound.tensors:
            continue
        reached = _descendants(node)
        if any(n.op == "output" for n in reached):
            raise CaptureError(f"constant input '{node.target}' flows into the model's output")
        for dead in reversed([n for n in graph.nodes if n in reached]):
            graph.erase_node(dead)
        graph.erase_node(node)
    gm.recompile()


def _descendants(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(node.users)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.users)
    return seen


def _plain(value: Any) -> Any:
    """fx stores output structures as immutable collections; users expect dict/list."""
    if isinstance(value, immutable_dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, immutable_list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return type(value)({k: _plain(v) for k, v in value.items()})
    return value


_PLAIN_DICTS = (dict, collections.OrderedDict, collections.defaultdict, immutable_dict)


def _flatten_output(gm: fx.GraphModule, typed: Sequence[dict] = ()) -> pytree.TreeSpec:
    """The output node returns a flat tuple; the spec rebuilds forward's structure. ``typed``:
    the dict subclass forward returned as fx saw it (values: proxies), when it did."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    value = output.args[0]
    if typed and isinstance(value, dict) and list(value) == list(typed[0]):
        leaves, spec = pytree.tree_flatten(typed[0])
        output.args = (tuple(x.node if isinstance(x, fx.Proxy) else x for x in leaves),)
        gm.recompile()
        return spec
    leaves, spec = pytree.tree_flatten(_plain(value))
    output.args = (tuple(leaves),)
    gm.recompile()
    return spec


# -- torch.export --------------------------------------------------------------------------------


def _capture_export(model: nn.Module, bound: BoundInputs, alone: bool = True) -> Captured:
    signature = inspect.signature(model.forward)
    kwargs = {**_unaliased(bound.tensors), **bound.constants}
    # dim 0 of every tensor input is the one batch dimension: export it symbolically, so the
    # graph runs at any micro-batch size instead of being specialised to the example's.
    batch = torch.export.Dim("batch", min=1)
    dynamic = {name: ({0: batch} if name in bound.tensors else None) for name in kwargs}
    check_root_pre_hooks(model, alone)
    try:
        with rebinding_recorded(model) as rebound, tensor_hooks_recorded() as hooked, \
                attribute_assignments_recorded() as assigned:
            program = torch.export.export(
                model, args=(), kwargs=kwargs, dynamic_shapes=dynamic, strict=False
            )
    except Exception as exc:
        raise CaptureError(_describe_failure("torch.export", exc, model, alone)) from None
    if hooked:
        raise CaptureError(
            f"{type(model).__name__}.forward registers a gradient hook on a tensor ({hooked[0]}):"
            " torch.export does not record it, so the pipeline would silently skip it (and "
            "torch.fx cannot trace it). Register hooks on parameters outside forward "
            "(parameter.register_hook), or write the gradient change as a "
            "torch.autograd.Function")
    excused = recomputed_by_hooks(model)
    assigned = [a for a in assigned if a not in excused]
    if assigned:
        raise CaptureError(
            f"{type(model).__name__}.forward stores a tensor on the model ({assigned[0]} = ...)"
            f"{_defined_at(model)}: torch.export does not keep attributes set in forward, so "
            "after a pipeline step it would silently be missing or stale. Register it as a "
            "buffer (register_buffer) and update it in place, or return it")
    gm = program.module()
    mark_rebinds(model, gm, rebound, alone)
    info = gm.graph._codegen.pytree_info
    leaves = pytree.tree_leaves(((), kwargs))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    flat_names = _leaf_names(kwargs)
    for node, leaf, name in zip(placeholders, leaves, flat_names):
        if isinstance(leaf, torch.Tensor):
            node.target = name
            node._rename(name)
        elif node.users:
            raise CaptureError(f"constant input {name}={leaf!r} is used as a tensor")
        else:
            gm.graph.erase_node(node)
    for node in list(gm.graph.nodes):  # torch.export's runtime input guards: not part of the model
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
        # and its checks that a `.to(...)`'s input has the dtype seen at export: under
        # precision="bf16"/"fp16" autocast makes it another, and they raised a bare
        # "Tensor dtype mismatch" on the first step (eager autocast runs the same code)
        elif node.op == "call_function" and node.target is _ASSERT_METADATA and not node.users:
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.graph._codegen = fx.graph.CodeGen()
    place_write_backs(gm)
    keep_mutations(gm)
    _name_after_modules(gm)
    # A fresh GraphModule: the unlifted one carries pre-hooks that check the pytree input spec.
    gm = fx.GraphModule(gm, gm.graph, type(model).__name__)
    return Captured(gm, list(bound.tensors), info.out_spec, "export", signature, bound.constants)


_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default


def _unaliased(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The example inputs, each with its own storage. torch.export reads inputs that share
    memory (``labels=input_ids``, the Hugging Face causal-LM idiom) through one placeholder:
    the graph then embedded ``labels``, and every step with other labels was silently wrong."""
    seen: set[Any] = set()
    out = {}
    for name, t in tensors.items():
        key = t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)
        out[name] = t.clone() if key in seen else t
        seen.add(key)
    return out


def _leaf_names(kwargs: dict[str, Any]) -> list[str]:
    names = []
    for key, value in kwargs.items():
        names.extend([key] * max(1, len(pytree.tree_leaves(value))))
    return names


_SELF_PREFIX = re.compile(r"^L__self___?")


def _name_after_modules(gm: fx.GraphModule) -> None:
    """aten nodes are called ``linear_17``; prefix the module they came from: ``h_3_mlp_linear``."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        stack = node.meta.get("nn_module_stack") or {}
        if not stack:
            continue
        path = list(stack.values())[-1][0]
        path = path.replace("L['self'].", "").replace("L__self__.", "")
        if not path:
            continue
        try:
            gm.get_submodule(path)
        except AttributeError:  # export's own bookkeeping frames, not a model module
            continue
        parts = [p for p in re.split(r"[.\[\]'\"]+", path) if p]
        prefix = "_".join(parts).lower()
        base = re.sub(r"_\d+$", "", node.name)
        node._rename(f"{prefix}_{base}")


# -- error messages ------------------------------------------------------------------------------

_LIBRARY_PATHS = (
    "/torch/", "/varuna_fx/", "/transformers/", "/contextlib.py", "/functools.py", "/sympy/",
)


# Never the model's code: the tracers, this package and generated code ("<string>", "<eval>").
_OUR_PATHS = ("/torch/", "/varuna_fx/", "/contextlib.py", "/functools.py", "/sympy/")


def _user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if not any(p in f.filename for p in _LIBRARY_PATHS)
            and not f.filename.startswith("<")]
    if not user:
        # A model defined inside a library (e.g. transformers) still has a best guess: the last
        # frame of that library, never a tracer's or varuna_fx's own line.
        user = [f for f in frames if not any(p in f.filename for p in _OUR_PATHS)
                and not f.filename.startswith("<")]
    return user[-1] if user else None


def _defined_at(model: nn.Module, method: str = "forward") -> str:
    """' (forward at file:line)' for the model's forward (or another method), or '' when its
    source is unknown."""
    try:
        function = inspect.unwrap(getattr(type(model), method))
        path = inspect.getsourcefile(function)
        line = inspect.getsourcelines(function)[1]
    except (TypeError, OSError, AttributeError):
        return ""
    return f" ({type(model).__name__}.{method} at {path}:{line})"


def _describe_failure(tracer: str, exc: BaseException, model: nn.Module,
                      alone: bool = True) -> str:
    """``alone``: the user chose this tracer (so the other one is worth suggesting)."""
    frame = _user_frame(exc)
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if len(reason) > 300:
        reason = reason[:300] + "..."
    where = ""
    if frame is not None:
        line = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
        where = f" at {frame.filename}:{frame.lineno} in {frame.name}: `{line}`"
    else:  # the tracer failed before running any of the model's code: name its forward
        where = _defined_at(model).replace(" (", " in ", 1).rstrip(")")
    data_dependent = any(key in f"{type(exc).__name__} {reason}" for key in (
        "control flow", "DataDependent", "data-dependent", "__bool__"))
    if "cache_utils." in reason and "not a known type" in reason:
        hint = (
            "the model returns its key/value cache (a Hugging Face model with use_cache=True, "
            "the default of its config), which is no tensor a pipeline could pass on: set "
            "model.config.use_cache = False before vf.compile (training needs no cache)"
        )
    elif "Constraints violated (batch)" in reason:
        hint = (
            "forward's code fixes the batch size (dim 0) to the example's, e.g. by computing "
            "with it in Python or numpy (a Hugging Face wav2vec2's SpecAugment masking, "
            "config.mask_time_prob > 0); a pipeline runs micro-batches of other sizes, so "
            "compute it with torch operations on the tensors, or turn that feature off"
        )
    elif data_dependent:
        hint = (
            "Python control flow (if/while/bool()) that depends on tensor values cannot be "
            "traced: rewrite it with torch.where or torch.cond, move it out of forward, or make "
            "it depend only on shapes or constants"
        )
    else:
        other = "'export'" if tracer == "torch.fx" else "'fx'"
        hint = f"this operation cannot be traced by {tracer}" + (
            f": try tracer={other} or 'auto'" if alone else "")
    return f"{tracer} failed{where} ({type(exc).__name__}: {reason}). {hint}"


