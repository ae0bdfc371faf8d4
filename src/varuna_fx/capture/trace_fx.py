"""torch.fx symbolic tracing into the canonical graph (see ``trace.py``)."""

from __future__ import annotations

import inspect
import os
import sys
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from ..errors import CaptureError, InputError
from ..ir.nodes import info as node_info
from . import autograd_functions
from .autograd_functions import functions_kept
from .captured import Captured
from .failures import defined_at, describe_failure
from .grad_mode import check_no_grad_blocks
from .inputs import BoundInputs
from .mutations import keep_mutations
from .outputs import PLAIN_DICTS, flatten_output
from .shape_values import ShapeValues, Unknown, same_everywhere
from .trace_export import stage_device

# -- fx ------------------------------------------------------------------------------------------


class Tracer(fx.Tracer):
    # Each node keeps its source lines (error messages and the generated stage code show them),
    # but not through fx's own ``record_stack_traces``: in torch 2.13 that symbolizes frames
    # with the profiler and filters them with ``symbolic_shapes.uninteresting_files()``, whose
    # first call imports torch._dynamo, torch._inductor and torch.export (a restarted job's
    # compile pays for it: bench/RESULTS.md, "Figures the code cites") -- and it still kept
    # fx's own frames. See ``create_node``.
    record_stack_traces = False
    # Buffers (causal masks, rotary tables) become get_attr nodes instead of baked constants,
    # so they may be sliced by traced sizes and are owned by the stages that read them.
    proxy_buffer_attributes = True

    def __init__(self, shapes: ShapeValues | None = None) -> None:
        super().__init__()
        self.shapes = shapes  # concrete values where Python needs one (shape_values.py)
        # nodes made under torch.no_grad() in forward (fx records no grad mode: capture/grad_mode.py)
        self.no_grad_nodes: set[fx.Node] = set()
        self.typed_dicts: list[dict] = []  # see create_arg
        # the first node made inside a torch.autocast block in forward (fx records none)
        self.autocast_start = _autocast_state()
        self.autocast_node: fx.Node | None = None

    def create_arg(self, a: Any) -> Any:
        # fx stores a dict subclass (a HuggingFace ModelOutput dataclass) as a plain dict:
        # keep the object, so the pipeline returns the type forward does (flatten_output)
        if isinstance(a, dict) and type(a) not in PLAIN_DICTS \
                and type(a) in pytree.SUPPORTED_NODES:
            self.typed_dicts.append(a)
        return super().create_arg(a)

    def to_bool(self, obj: fx.Proxy) -> bool:
        """``assert t <= block_size``, ``if x.device.type == "cpu"``: the value the example's
        shapes give, the same at every batch size (shape_values.py)."""
        values = self._known(obj)
        if values is None:
            return super().to_bool(obj)
        if not same_everywhere([bool(v) for v in values]):
            raise fx.proxy.TraceError(
                "a condition on shapes depends on the batch size (dim 0): it is "
                f"{[bool(v) for v in values]} at batch sizes {self.shapes.sizes}")
        return bool(values[0])

    def iter(self, obj: fx.Proxy) -> Iterator[Any]:
        """``*x.shape[:-1]``, ``for d in x.size()``, ``for y in h.chunk(2)``: the items of a
        sequence whose length is the same at every batch size."""
        length = self._length(obj)
        if length is None:
            return super().iter(obj)
        return iter([obj[i] for i in range(length)])

    def length(self, obj: fx.Proxy) -> int:
        """``len(x.shape)``, and the length hint Python takes when ``*x.shape[:-1]`` is
        unpacked into a call."""
        length = self._length(obj)
        if length is None:
            raise fx.proxy.TraceError(
                "len() of a traced value whose length the example's shapes do not give")
        return length

    def _values(self, obj: fx.Proxy) -> list[Any] | None:
        """The proxy's value at each batch size the shapes were run at, or None."""
        if self.shapes is None:
            return None
        try:
            return self.shapes.values(obj.node)
        except Unknown:
            return None

    def _length(self, obj: fx.Proxy) -> int | None:
        values = self._values(obj)
        if values is None:
            return None
        if not all(isinstance(v, (tuple, list)) for v in values) or \
                len({len(v) for v in values}) != 1:
            return None
        return len(values[0])

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ShapeProxy(node, self)

    def _known(self, obj: fx.Proxy) -> list[Any] | None:
        """The proxy's plain value (sizes, bools, devices) at each batch size, or None."""
        values = self._values(obj)
        if values is None:
            return None
        plain = (bool, int, float, str, torch.device, torch.dtype, torch.Size, tuple, list)
        if not all(isinstance(v, plain) and not isinstance(v, torch.Tensor) for v in values):
            return None
        leaves = [x for v in values for x in (v if isinstance(v, (tuple, list)) else [v])]
        if not all(isinstance(x, (bool, int, float, str, torch.device, torch.dtype))
                   for x in leaves):
            return None
        return values

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


class _ShapeProxy(fx.Proxy):
    """A proxy whose ``len()`` the tracer answers from shapes (fx's raises)."""

    def __len__(self) -> int:
        return self.tracer.length(self)  # type: ignore[attr-defined]

    def __getattr__(self, k: str) -> fx.proxy.Attribute:
        return _ShapeAttribute(self, k)


class _ShapeAttribute(fx.proxy.Attribute):
    def __len__(self) -> int:
        return self.tracer.length(self)  # type: ignore[attr-defined]


def _autocast_state() -> tuple:
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                 for d in ("cpu", "cuda"))


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FUNCTIONS_FILE = autograd_functions.__file__  # the opaque Function call's own frame


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
            if not file.startswith(_TORCH_DIR) and file != _FUNCTIONS_FILE]
    return "".join(traceback.StackSummary.from_list(kept).format()).strip()


def capture_fx(model: nn.Module, bound: BoundInputs, alone: bool = True) -> Captured:
    signature = inspect.signature(model.forward)
    concrete = dict(bound.constants)
    for name, param in signature.parameters.items():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if name not in bound.tensors and name not in concrete:
            if param.default is inspect.Parameter.empty:
                raise InputError(f"example_inputs give no value for '{name}'")
            concrete[name] = param.default
    deferred = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    tracer = Tracer(ShapeValues(model, bound, concrete,
                                stage_device(bound) if deferred else None))
    before = _module_attributes(model)
    try:
        # grad mode as in training (compile may be called under no_grad); forward's own
        # no_grad blocks show in tracer.no_grad_nodes
        # a user's autograd.Function stays one call with its own backward (autograd_functions)
        with torch.enable_grad(), warnings.catch_warnings(), functions_kept():
            # a tensor default (a constant of the graph) cannot be guarded: fx says so
            warnings.filterwarnings("ignore", "Was not able to add assertion")
            graph = tracer.trace(model, concrete_args=concrete or None)
    except Exception as exc:  # fx raises many kinds: TraceError, TypeError, AttributeError...
        raise CaptureError(describe_failure("torch.fx", exc, model, alone)) from None
    finally:
        assigned = _restore_proxy_attributes(model, before)
    _write_assigned_buffers(model, graph, assigned, alone)
    # before the code is made: a tensor default's placeholder names its constant as default
    _drop_concrete_placeholders(graph, bound)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    keep_mutations(gm)  # dead-code elimination that keeps `y.relu_()` statements
    autograd_functions.mark_writes(gm)
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
            f"{type(model).__name__} overrides __call__{defined_at(model, '__call__')}: "
            "torch.fx traces "
            "forward only, so what __call__ adds would be skipped. Move it into forward"
            + (", or use tracer='export' or 'auto'" if alone else ""))
    out_spec = flatten_output(gm, tracer.typed_dicts[-1:])
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
                f"not depend on the inputs or the model{defined_at(model)}: torch.fx does not "
                f"trace making it (torch.zeros(...) and the like), so the graph cannot write it. "
                f"Write it in place (self.{key}.zero_(), self.{key}.copy_(...))"
                + (" or try tracer='export'" if alone else ""))
        raise CaptureError(
            f"{type(model).__name__}.forward assigns a traced value to self.{fqn}"
            f"{defined_at(model)}: torch.fx cannot keep tensors stored on the model. Register "
            "it as a buffer (register_buffer) and update it in place, or return it")


def _drop_concrete_placeholders(graph: fx.Graph, bound: BoundInputs) -> None:
    """fx keeps a placeholder for each concrete arg, feeding only a guard: remove both (and
    the constant a tensor default's placeholder names as its default). A placeholder kept (a
    tensor the example gives) loses its default: every step passes it, and a tensor default
    is a get_attr node fx would name in the generated signature before the body defines it
    (``def forward(self, x, y = _tensor_constant0)``: a NameError when the code is made)."""
    for node in list(graph.nodes):
        if node.op != "placeholder":
            continue
        if node.target in bound.tensors:
            default = node.args[0] if node.args else None
            node.args = ()
            if isinstance(default, fx.Node) and default.op == "get_attr" and not default.users:
                graph.erase_node(default)
            continue
        reached = _descendants(node)
        if any(n.op == "output" for n in reached):
            raise CaptureError(f"constant input '{node.target}' flows into the model's output")
        for dead in reversed([n for n in graph.nodes if n in reached]):
            graph.erase_node(dead)
        default = node.args[0] if node.args else None
        graph.erase_node(node)
        if isinstance(default, fx.Node) and default.op == "get_attr" and not default.users:
            graph.erase_node(default)


def _descendants(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(node.users)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.users)
    return seen
