"""Whether a ``loss_fn`` mixes samples (an in-batch contrastive loss), found at the first step.

A ``loss_fn`` runs outside the captured graph, on each micro-batch's output and target. On the
first step, the last stage traces it with torch.fx (over the output's and target's tensors)
and runs the trace, without gradients, on the first micro-batch and on that micro-batch less
one sample (or twice over, for a micro-batch of one): the two runs say which dimensions of
each value scale with the batch, and ``passes/sample_mixing.py``'s analysis finds statistics
over the batch, batch x batch products and positions in the batch, as for the model's own
graph. Real tensors on purpose: fake or meta tensors, or any dispatch mode, would import
torch._dynamo (an import a restarted job otherwise never pays: bench/RESULTS.md, "Figures the
code cites"). A ``loss_fn`` that fx cannot
trace, or that fails on the smaller batch, is not judged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..passes.sample_mixing import Finding, find_sample_mixing, ops_of_graph


def _trace(loss_fn: Callable[..., Any], leaves: list[Any], spec: pytree.TreeSpec
           ) -> fx.GraphModule:
    """``loss_fn(output, target)`` as an fx graph over the tensors among ``leaves`` (one
    placeholder each; fx traces a fixed number of named inputs, not ``*args``)."""
    root = torch.nn.Module()
    if isinstance(loss_fn, torch.nn.Module):
        root.loss_fn = loss_fn  # a loss module stays a call_module node
    tracer = fx.Tracer()
    tracer.root = root
    tracer.graph = fx.Graph(tracer_cls=fx.Tracer)
    tracer.tensor_attrs = {}
    proxies = [tracer.create_proxy("placeholder", f"x{k}", (), {})
               if isinstance(leaf, torch.Tensor) else leaf for k, leaf in enumerate(leaves)]
    output, target = pytree.tree_unflatten(proxies, spec)
    call = root.loss_fn if isinstance(loss_fn, torch.nn.Module) else loss_fn
    result = call(output, target) if not isinstance(loss_fn, torch.nn.Module) else \
        tracer.call_module(root.loss_fn, root.loss_fn.forward, (output, target), {})
    tracer.create_node("output", "output", (tracer.create_arg(result),), {})
    return fx.GraphModule(root, tracer.graph)


class _Shapes(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.shapes: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        self.shapes[n] = tuple(value.shape) if isinstance(value, torch.Tensor) else (
            "tuple" if isinstance(value, (tuple, list)) and value
            and all(isinstance(v, torch.Tensor) for v in value) else None)
        return value


def loss_fn_findings(loss_fn: Callable[..., Any], output: Any, target: Any,
                     batch: int) -> list[Finding]:
    """Where ``loss_fn`` mixes the samples of a micro-batch of ``batch`` samples; [] when it
    does not, or when it cannot be judged."""
    leaves, spec = pytree.tree_flatten((output, target))
    tensors = [t.detach() for t in leaves if isinstance(t, torch.Tensor)]
    batched = [t.dim() > 0 and t.shape[0] == batch for t in tensors]
    if not any(batched):
        return []
    try:
        gm = _trace(loss_fn, leaves, spec)

        def run(size: int) -> dict[fx.Node, Any]:
            if size <= batch:
                args = [t[:size] if b else t for t, b in zip(tensors, batched)]
            else:
                args = [torch.cat([t, t]) if b else t for t, b in zip(tensors, batched)]
            shapes = _Shapes(gm)
            with torch.no_grad():
                shapes.run(*args)
            return shapes.shapes

        first = run(batch)
        second = run(batch - 1 if batch > 1 else 2)
    except Exception:  # noqa: BLE001 - a loss_fn fx cannot trace (or run smaller): not judged
        return []

    def dims(node: Any) -> int:
        a, c = first.get(node), second.get(node)
        if not isinstance(a, tuple) or not isinstance(c, tuple) or len(a) != len(c):
            return -1  # not a tensor
        return sum(1 for x, y in zip(a, c) if x != y)

    ops, outputs = ops_of_graph(gm, dims=dims,
                                tuple_valued=lambda n: first.get(n) == "tuple")
    where = _defined_at(loss_fn)
    return [Finding(f.op, f.reason, where) for f in find_sample_mixing(ops, outputs)]


def _defined_at(function: Any) -> str:
    try:
        function = inspect.unwrap(function)
        return f"{inspect.getsourcefile(function)}:{inspect.getsourcelines(function)[1]}"
    except (TypeError, OSError):
        return ""
