"""The values of fx proxies, where Python needs one: shape code traced with concrete sizes.

torch.fx gives every value a proxy, so Python that needs a real value stops the trace:
``assert t <= self.config.block_size`` (``bool`` of a size), ``if h.device.type == "cpu"``,
``xq.reshape(*xq.shape[:-1], -1, 2)`` (iterating a shape). Those values are known from the
example's shapes: when the tracer asks for one (``Tracer.to_bool`` / ``Tracer.iter``), the
graph traced so far is run on fake tensors (no data, nothing allocated) at several batch sizes (1, 2, 3 and the example's),
and the answer is taken when it is the same at every one of them. A value that differs with the
batch size (``if x.size(0) > 2``) is refused: a pipeline runs micro-batches of other sizes.
One that depends on tensor values is not known (fake tensors have none) and fx's error stands.

The graph keeps the size reads as nodes; ``passes/specialize_sizes.py`` later makes each a
constant or arithmetic on the batch size. The evaluation runs only for a model whose trace
asks (and only up to the node asked about), so other models pay nothing. A
``vf.deferred_init`` model's meta weights are faked on the device the stages will run on, as
torch.export's capture does (``trace_export.stage_device``), so a device branch takes the
branch of that device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from .buffers import buffers_kept
from .inputs import BoundInputs


class Unknown(Exception):
    """The value cannot be known from shapes alone (it depends on tensor values, or
    evaluating the graph on fake tensors failed)."""


class ShapeValues:
    """Lazily evaluated values of a graph under construction, one environment per batch."""

    def __init__(self, root: nn.Module, bound: BoundInputs, concrete: dict[str, Any],
                 device: torch.device | None) -> None:
        self.root, self.bound, self.concrete = root, bound, concrete
        # 1 (where BatchNorm in training fails: then left out), 2, 3 and the example's
        self.batches = sorted({1, 2, 3, bound.batch_size or 2})
        self.failed: set[int] = set()  # batch sizes whose evaluation failed (only 1 may)
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.envs: list[dict[fx.Node, Any]] = [{} for _ in self.batches]
        self.device = device  # None: the inputs' own devices
        self._state: dict[str, torch.Tensor] | None = None

    def values(self, node: fx.Node) -> list[Any]:
        """``node``'s value at each batch size; raises :class:`Unknown`."""
        values = []
        with torch.no_grad(), _module_calls_unpatched(), self._meta_state_faked(), \
                buffers_kept(self.root), self.mode:
            for env, batch in zip(self.envs, self.batches):
                if batch in self.failed:
                    continue
                try:
                    values.append(self._value(node, env, batch))
                except Exception as exc:  # noqa: BLE001 - failed: not known from shapes
                    if batch != 1:
                        raise Unknown(str(exc)) from None
                    self.failed.add(batch)  # a batch of one fails BatchNorm in training
        return values

    @property
    def sizes(self) -> list[int]:
        """The batch sizes :meth:`values` answers for."""
        return [b for b in self.batches if b not in self.failed]

    def _value(self, node: fx.Node, env: dict[fx.Node, Any], batch: int) -> Any:
        if node in env:
            return env[node]
        for n in node.graph.nodes:  # append-only while tracing: earlier nodes are final
            if n not in env:
                env[n] = self._run(n, env, batch)
            if n is node:
                break
        return env[node]

    def _run(self, n: fx.Node, env: dict[fx.Node, Any], batch: int) -> Any:
        args = fx.node.map_arg(n.args, env.__getitem__)
        kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
        if n.op == "placeholder":
            t = self.bound.tensors.get(str(n.target))
            if t is None:
                return self.concrete.get(str(n.target), args[0] if args else None)
            return torch.empty((batch, *t.shape[1:]), dtype=t.dtype,
                               device=self.device or t.device)
        if n.op == "get_attr":
            value: Any = self.root
            for part in str(n.target).split("."):
                value = getattr(value, part)
            return value
        if n.op == "call_function":
            return n.target(*args, **kwargs)  # type: ignore[operator]
        if n.op == "call_method":
            return getattr(args[0], str(n.target))(*args[1:], **kwargs)
        if n.op == "call_module":
            return self.root.get_submodule(str(n.target))(*args, **kwargs)
        raise Unknown(f"a {n.op} node")

    @contextlib.contextmanager
    def _meta_state_faked(self) -> Iterator[None]:
        """Meta parameters and buffers (``vf.deferred_init``) as fakes on ``self.device``."""
        if self._state is None:
            self._state = {}
            named = [*self.root.named_parameters(remove_duplicate=False),
                     *self.root.named_buffers(remove_duplicate=False)]
            if self.device is not None and self.device.type != "meta":
                made: dict[int, torch.Tensor] = {}
                for name, t in named:
                    if t.is_meta:
                        if id(t) not in made:
                            fake = self.mode.from_tensor(t)
                            fake.fake_device = self.device
                            made[id(t)] = fake
                        self._state[name] = made[id(t)]
        if not self._state:
            yield
            return
        with torch.nn.utils.stateless._reparametrize_module(self.root, self._state,
                                                            tie_weights=True):
            yield


@contextlib.contextmanager
def _module_calls_unpatched() -> Iterator[None]:
    """nn.Module's own ``__call__`` and ``__getattr__`` while the graph is evaluated: fx's
    tracing patches both (a module call would add nodes to the graph being traced)."""
    from torch.fx import _symbolic_trace as traced

    module = torch.nn.Module
    patched = module.__dict__["__call__"], module.__dict__["__getattr__"]
    module.__call__ = traced._orig_module_call  # type: ignore[method-assign]
    module.__getattr__ = traced._orig_module_getattr  # type: ignore[method-assign]
    try:
        yield
    finally:
        module.__call__, module.__getattr__ = patched  # type: ignore[method-assign]


def same_everywhere(values: list[Any]) -> bool:
    first = values[0]
    return all(type(v) is type(first) and v == first for v in values[1:])
