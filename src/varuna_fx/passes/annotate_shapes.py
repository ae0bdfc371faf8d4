"""annotate_shapes: output shapes, dtypes, bytes and raw FLOP counts of every node.

The graph runs twice on fake tensors (``FakeTensorMode``: shapes and dtypes only, no memory and
no compute), at two batch sizes. Every size that changes between the runs is linear in the
batch, so each dimension, byte count and FLOP count is fitted as ``const + per_sample * b``
(see :class:`varuna_fx.ir.nodes.Affine`). A dispatch-level recorder counts matmul-class FLOPs with
torch's own formulas (``torch.utils.flop_counter``), one FLOP per output element for every
other non-view aten op, and notices random ops (``Tag.nondeterministic_seeded``: dropout & co).

What the two runs observe is cached on disk (``shape_cache.py``): a process compiling the same
model on the same shapes again (a restarted job) derives the annotations from the stored
observations without running anything on fake tensors.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ..capture.buffers import buffers_kept
from ..capture.inputs import BoundInputs
from ..capture.trace_export import stage_device
from ..errors import CaptureError
from ..ir.nodes import Affine, TensorInfo, b, info
from ..ir.rng import draws, leading_dim
from . import shape_cache

_RANDOM_MODULES = ("Dropout",)  # by class name: also catches user subclasses


@dataclass
class _Observed:
    shapes: list[tuple[int, ...]]  # what is kept on disk, too (shape_cache.py)
    dtypes: list[torch.dtype]
    is_tensor: bool
    out_bytes: int
    matmul_flops: int
    elementwise_flops: int
    random: bool
    draws: list[int]  # each random op's leading dimension (ir/rng.leading_dim; -1: none)
    draw_shapes: list[list[int]]  # each random op's result's shape (its first tensor's)
    bounded: bool = False  # a size that depends on values, taken at its bound (_bounded_output)


class _OpRecorder(TorchDispatchMode):
    """Counts FLOPs and notices random ops of whatever runs inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.reset()

    def reset(self) -> None:
        self.bounded = False
        self.matmul = 0
        self.elementwise = 0
        self.random = False
        self.draws: list[int] = []
        self.draw_shapes: list[list[int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except DynamicOutputShapeException:
            out = _bounded_output(func, args, kwargs)
            self.bounded = True
        packet = func._overloadpacket
        if draws(func, args, kwargs):  # a seeded op that draws (not SDPA at dropout_p=0)
            self.random = True
            lead = leading_dim(func, args, kwargs)
            self.draws.append(-1 if lead is None else lead)
            first = next((t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)),
                         None)
            self.draw_shapes.append([] if first is None else [int(d) for d in first.shape])
        if packet in flop_registry:
            self.matmul += int(flop_registry[packet](*args, **kwargs, out_val=out))
        elif not func.is_view:
            self.elementwise += sum(
                t.numel() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
            )
        return out


def _bounded_output(func: Any, args: tuple, kwargs: dict) -> Any:
    """The result of an op whose size depends on values (``nonzero``, ``torch.where(mask)``,
    ``masked_select``: a mixture of experts' routing), at its largest: every element kept.
    Fake tensors have no values; the bound makes the ops after it cost what they would if all
    were kept (an upper bound), instead of failing the pass."""
    if func is torch.ops.aten.nonzero.default:
        x = args[0]
        return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
    if func is torch.ops.aten.masked_select.default:
        x, mask = args[0], args[1]
        shape = torch.broadcast_shapes(x.shape, mask.shape)
        return torch.empty((math.prod(shape),), dtype=x.dtype, device=x.device)
    raise DynamicOutputShapeException(func)


class _FakeRun(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, recorder: _OpRecorder) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.recorder = recorder
        self.observed: dict[fx.Node, _Observed] = {}

    def run_node(self, n: fx.Node) -> Any:
        self.recorder.reset()
        if info(n).rebinds:  # before copy_ fails or casts
            buffer, value = self.fetch_args_kwargs_from_env(n)[0][:2]
            _check_rebinding(self.module, n, (tuple(buffer.shape), buffer.dtype),
                             (tuple(value.shape), value.dtype)
                             if isinstance(value, torch.Tensor) else None)
        try:
            with _shape_only_momentum(self.module, n):
                value = super().run_node(n)
        except Exception as exc:
            where = n.meta.get("stack_trace", "").strip().splitlines()[-2:]
            raise CaptureError(
                f"running node '{n.name}' ({n.format_node()}) on fake tensors failed: "
                f"{type(exc).__name__}: {exc}. Source: {' '.join(s.strip() for s in where)}"
            ) from None
        tensors = [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
        # downstream of a bounded size, a shape is a bound too (specialize_sizes keeps reads)
        bounded = self.recorder.bounded or any(
            self.observed[i].bounded for i in n.all_input_nodes if i in self.observed)
        random = (self.recorder.random or _is_random_module(self.module, n)) \
            and not _is_inactive_dropout(self.module, n)
        self.observed[n] = _Observed(
            shapes=[tuple(t.shape) for t in tensors],
            dtypes=[t.dtype for t in tensors],
            is_tensor=isinstance(value, torch.Tensor),
            out_bytes=sum(t.numel() * t.element_size() for t in tensors),
            matmul_flops=self.recorder.matmul,
            elementwise_flops=self.recorder.elementwise,
            random=random,
            draws=list(self.recorder.draws),
            draw_shapes=list(self.recorder.draw_shapes),
            bounded=bounded,
        )
        return value


def _check_rebinding(gm: fx.GraphModule, n: fx.Node, buffer: tuple[tuple[int, ...], torch.dtype],
                     value: tuple[tuple[int, ...], torch.dtype] | None) -> None:
    """A pipeline's stages hold each buffer and write the tensor forward rebinds it to into it
    in place (``self.ema = ...``): eager's rebinding only for a tensor of the buffer's shape
    and dtype (another would be cast, broadcast or fail, where eager swaps the tensor).
    ``buffer``/``value``: (shape, dtype) of each; ``value`` None when it is no tensor."""
    if value == buffer:
        return
    def form(f: tuple[tuple[int, ...], torch.dtype]) -> str:
        return f"a {str(f[1]).removeprefix('torch.')} tensor of shape {f[0]}"
    name = info(n).rebinds
    where = " ".join(s.strip() for s in n.meta.get("stack_trace", "").strip().splitlines()[-2:])
    raise CaptureError(
        f"{type(gm).__name__}.forward rebinds buffer self.{name} ({form(buffer)}) to "
        f"{form(value) if value else 'a non-tensor'}{' (' + where + ')' if where else ''}: a "
        "pipeline keeps a buffer's shape and dtype (its stage holds it and writes the new value "
        "in place). Give the buffer its final shape and dtype before vf.compile "
        f"(register_buffer, or model.{name} = model.{name}.to(...)), or convert in forward: "
        f"self.{name} = (...).to(self.{name}.dtype); a value whose shape changes is better "
        "returned than stored")


@contextlib.contextmanager
def _shape_only_momentum(root: torch.nn.Module, n: fx.Node) -> Iterator[None]:
    """``BatchNorm(momentum=None)`` divides by ``float(num_batches_tracked)``, a value a fake
    tensor does not have; any momentum gives the same shapes (and buffers are restored)."""
    module = root.get_submodule(str(n.target)) if n.op == "call_module" else None
    if not isinstance(module, torch.nn.modules.batchnorm._BatchNorm) or \
            module.momentum is not None:
        yield
        return
    module.momentum = 0.1
    try:
        yield
    finally:
        module.momentum = None


def _is_inactive_dropout(root: torch.nn.Module, n: fx.Node) -> bool:
    """``nn.Dropout(p=0)`` still calls the seeded kernel but draws a mask of ones."""
    if n.op != "call_module":
        return False
    module = root.get_submodule(n.target)
    return any(r in type(module).__name__ for r in _RANDOM_MODULES) and \
        getattr(module, "p", None) == 0


def _is_random_module(root: torch.nn.Module, n: fx.Node) -> bool:
    """A dropout that draws: in training with p > 0 (its module's settings, or a functional
    dropout's constant arguments; one whose arguments are computed counts)."""
    if n.op == "call_module":
        module = root.get_submodule(n.target)
        is_dropout = any(r in type(module).__name__ for r in _RANDOM_MODULES)
        # Dropout(0) and a dropout in eval draw nothing
        return is_dropout and getattr(module, "p", 1.0) > 0 and module.training
    if n.op == "call_function":
        if getattr(n.target, "__name__", "") not in ("dropout", "dropout1d", "dropout2d",
                                                     "alpha_dropout", "feature_alpha_dropout"):
            return False
        p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
        training = n.args[2] if len(n.args) > 2 else n.kwargs.get("training", n.kwargs.get(
            "train", True))
        return not (p == 0 or training is False)
    return False


def _run_fake(gm: fx.GraphModule, bound: BoundInputs, batch: int) -> dict[fx.Node, _Observed]:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    recorder = _OpRecorder()
    state = {n: t for n, t in [*gm.named_parameters(remove_duplicate=False),
                               *gm.named_buffers(remove_duplicate=False)] if t.is_meta}
    device = stage_device(bound) if state else None
    with mode:
        fake = [torch.empty((batch, *t.shape[1:]), dtype=t.dtype, device=device or t.device)
                for t in bound.tensors.values()]
    runner = _FakeRun(gm, recorder)
    # Tracing-time RNG, autograd and module state must not leak into the user's program.
    with torch.no_grad(), _meta_state_faked(gm, mode, state, device), mode, recorder:
        runner.run(*fake)
    return runner.observed


@contextlib.contextmanager
def _meta_state_faked(gm: fx.GraphModule, mode: FakeTensorMode, state: dict[str, torch.Tensor],
                      device: torch.device | None) -> Iterator[None]:
    """A model on meta (``vf.deferred_init``) runs with fake parameters and buffers on the
    device its stages will run on, the one capture traced for (``trace_export.stage_device``):
    the graph may make tensors there (``torch.ones(..., device=x.device)``), which meta weights
    would not meet. Meta inputs (planning only) keep everything on meta."""
    if device is None or device.type == "meta" or not state:
        yield
        return
    made: dict[int, torch.Tensor] = {}
    for t in state.values():
        if id(t) not in made:
            fake = mode.from_tensor(t)
            fake.fake_device = device
            made[id(t)] = fake
    with torch.nn.utils.stateless._reparametrize_module(
            gm, {n: made[id(t)] for n, t in state.items()}, tie_weights=True):
        yield


def _observe(gm: fx.GraphModule, bound: BoundInputs, b1: int, b2: int
             ) -> tuple[dict[fx.Node, _Observed], dict[fx.Node, _Observed]]:
    """Both fake runs' observations: from the disk cache when it holds this graph."""
    key = shape_cache.graph_key(gm, bound)
    nodes = list(gm.graph.nodes)
    names = [n.name for n in nodes]
    if key is not None:
        stored = shape_cache.load(key, names)
        decoded = _decode(nodes, stored) if stored is not None else None
        if decoded is not None:
            return decoded
    with buffers_kept(gm):  # the fake runs must not count as BatchNorm updates
        first = _run_fake(gm, bound, b1)
        second = _run_fake(gm, bound, b2)
    if key is not None:
        shape_cache.store(key, names, [
            [_encode(first[n]), _encode(second[n])] if n in first and n in second else None
            for n in nodes])
    return first, second


def _encode(o: _Observed) -> dict[str, Any]:
    return {**asdict(o), "dtypes": [str(d) for d in o.dtypes]}


def _decode(nodes: list[fx.Node], stored: list[Any]
            ) -> tuple[dict[fx.Node, _Observed], dict[fx.Node, _Observed]] | None:
    """Observations from a cache entry, or None when the entry is malformed."""
    first: dict[fx.Node, _Observed] = {}
    second: dict[fx.Node, _Observed] = {}
    try:
        for node, pair in zip(nodes, stored, strict=True):
            if pair is None:
                continue
            o1, o2 = (_Observed(**fields) for fields in pair)
            for o in (o1, o2):
                o.shapes = [tuple(int(d) for d in shape) for shape in o.shapes]
                o.dtypes = [_dtype(d) for d in o.dtypes]
                o.draw_shapes = [[int(d) for d in shape] for shape in o.draw_shapes]
                if not all(isinstance(v, bool) for v in (o.is_tensor, o.random, o.bounded)) or \
                        not all(isinstance(v, int) for v in o.draws) or \
                        len(o.draw_shapes) != len(o.draws) or \
                        not all(isinstance(v, int) for v in (o.out_bytes, o.matmul_flops,
                                                             o.elementwise_flops)):
                    raise TypeError("a field of the wrong type")
            first[node], second[node] = o1, o2
    except (TypeError, ValueError):
        shape_cache.stats["ignored"] += 1
        return None
    return first, second


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype: {name!r}")
    return dtype


def annotate_shapes(gm: fx.GraphModule, bound: BoundInputs) -> None:
    """Write outputs/bytes/FLOPs (affine in the micro-batch size ``b``) into node.meta."""
    b1 = bound.batch_size
    b2 = 2 * b1 + 1
    first, second = _observe(gm, bound, b1, b2)
    for node in gm.graph.nodes:  # fake runs check this too; the disk cache skips them
        if info(node).rebinds and node in first:
            buffer, value = node.args[0], node.args[1]
            for seen in (first, second):
                _check_rebinding(gm, node, _form(seen, buffer), _form(seen, value))
    for node in gm.graph.nodes:
        meta = info(node)
        frames = node.meta.get("stack_trace", "")
        meta.source = _last_source_line(frames)
        meta.module_path = _module_path(node)
        if node not in first:
            continue
        o1, o2 = first[node], second[node]
        meta.is_tensor = o1.is_tensor
        meta.random = o1.random
        if o1.bounded or o2.bounded:  # read by specialize_sizes, which runs next
            node.meta["varuna_bounded_size"] = True
        # every random op that draws (ir/rng.draws, as eager's keyed draws count them): drawn
        # per sample where its leading dimension is the batch in both runs (ir/rng.py)
        meta.random_draws = tuple(d1 == b1 and d2 == b2 for d1, d2 in zip(o1.draws, o2.draws))
        meta.random_layout = _layout_dependent_draw(o1, o2, b1, b2) if o1.random else ""
        meta.outputs = [
            TensorInfo(_fit_shape(s1, s2, b1, b2), dtype)
            for s1, s2, dtype in zip(o1.shapes, o2.shapes, o1.dtypes)
        ]
        meta.out_bytes = _fit_count(b1, o1.out_bytes, b2, o2.out_bytes)
        meta.matmul_flops = _fit_count(b1, o1.matmul_flops, b2, o2.matmul_flops)
        meta.elementwise_flops = _fit_count(b1, o1.elementwise_flops, b2, o2.elementwise_flops)
    for node in gm.graph.nodes:
        # Activations read, not weights: an embedding reads a few rows of its table, and a
        # matmul is compute-bound anyway. (fx's module calls never see their weights as
        # inputs; this keeps export's get_attr inputs consistent with that.)
        meta = info(node)
        meta.in_bytes = sum((info(i).out_bytes for i in node.all_input_nodes
                             if i.op != "get_attr"), Affine())


def _layout_dependent_draw(o1: _Observed, o2: _Observed, b1: int, b2: int) -> str:
    """The shape of the first random draw of a node that grows with the batch but is not one
    row per sample on dim 0 (``torch.randn(d, b)``, ``torch.rand(h.numel())``): keyed per
    sample it cannot be, shared its values change with the micro-batch size ("" if none)."""
    for d1, d2, s1, s2 in zip(o1.draws, o2.draws, o1.draw_shapes, o2.draw_shapes):
        if (d1 == b1 and d2 == b2) or math.prod(s1) == math.prod(s2):
            continue  # per sample, or one draw without the batch in it (as eager's)
        dims = _fit_shape(tuple(s1), tuple(s2), b1, b2)
        return "(" + ", ".join(str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"
    return ""


def _fit_count(b1: int, v1: float, b2: int, v2: float) -> Affine:
    """A byte or FLOP count as ``const + per_sample * b``. A count that grows faster than the
    batch (a batch x batch product: ``c * b**2``) fits a negative ``const``, so the line would
    go below zero for small micro-batches (negative bytes on a link); it becomes the line
    through zero and the example's count instead, ``c * b1 * b``: exact at the example's
    batch ``b1`` and above the true count for every micro-batch size up to it."""
    fitted = Affine.fit(b1, v1, b2, v2)
    if fitted.const < 0:
        return Affine(0.0, v1 / b1)
    return fitted


def _form(seen: dict[fx.Node, _Observed], node: Any
          ) -> tuple[tuple[int, ...], torch.dtype] | None:
    """(shape, dtype) of a node's tensor value in one run, or None for a non-tensor."""
    o = seen.get(node) if isinstance(node, fx.Node) else None
    return (tuple(o.shapes[0]), o.dtypes[0]) if o is not None and o.is_tensor else None


def _fit_shape(s1: tuple[int, ...], s2: tuple[int, ...], b1: int, b2: int) -> tuple[sympy.Expr, ...]:
    if len(s1) != len(s2):  # rank depends on the batch: keep the example's shape
        return tuple(_dim(int(d), 0) for d in s1)
    dims = []
    for d1, d2 in zip(s1, s2):
        slope = (int(d2) - int(d1)) // (b2 - b1) if (int(d2) - int(d1)) % (b2 - b1) == 0 else None
        if slope is None:  # not linear in the batch: keep the example's size
            dims.append(_dim(int(d1), 0))
        else:
            dims.append(_dim(int(d1) - slope * b1, slope))
    return tuple(dims)


@functools.lru_cache(maxsize=4096)
def _dim(const: int, per_sample: int) -> sympy.Expr:
    """``const + per_sample * b``; cached, since sympy arithmetic is slow and sizes repeat."""
    return sympy.Integer(const) + sympy.Integer(per_sample) * b


def _last_source_line(stack_trace: str) -> str:
    """'File "x.py", line 12, in forward' -> 'x.py:12'."""
    lines = [ln.strip() for ln in (stack_trace or "").splitlines()
             if ln.strip().startswith("File") and "/torch/" not in ln]
    if not lines:
        return ""
    last = lines[-1]
    try:
        path = last.split('"')[1]
        lineno = last.split("line ")[1].split(",")[0]
    except IndexError:
        return ""
    return f"{path.rsplit('/', 1)[-1]}:{lineno}"


def _module_path(node: fx.Node) -> str:
    if node.op in ("call_module", "get_attr"):
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return str(path).replace("L['self'].", "").replace("L__self__.", "")
