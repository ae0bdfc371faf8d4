"""specialize_sizes: sizes read off activations become constants or batch-size arithmetic.

``B, T, C = x.size()`` inside an attention block reads the shape of an activation. The value is
an int, which cannot cross a stage boundary, so without this pass no cut could fall between the
``size()`` and its last use -- a whole attention block becomes one uncuttable unit. The shapes
are known from ``annotate_shapes`` as ``const + per_sample * b``: a dimension that does not
depend on the batch becomes the constant, one that does becomes arithmetic on
``<first input>.size(0)``. Both depend only on model inputs, so ``mark_replicable`` lets every
stage compute them itself. (The pipeline is compiled for the example's non-batch sizes anyway;
the runtime checks that step inputs keep them.)
"""

from __future__ import annotations

import builtins
import operator

import sympy
import torch
import torch.fx as fx
from torch.fx.node import map_arg

from ..ir.nodes import b, info


def _size_dim(node: fx.Node) -> tuple[fx.Node, int | None] | None:
    """(tensor, dim or None for all dims) if ``node`` reads a tensor's size."""
    if node.op == "call_method" and node.target == "size" and not node.kwargs:
        dim = node.args[1] if len(node.args) > 1 else None
        return (node.args[0], dim) if dim is None or isinstance(dim, int) else None
    if node.op == "call_function" and node.target is builtins.getattr and \
            node.args[1:] == ("shape",):
        return node.args[0], None
    if node.op == "call_function" and node.target is torch.ops.aten.sym_size.int:
        return node.args[0], node.args[1]
    return None


def specialize_sizes(gm: fx.GraphModule) -> int:
    """Rewrite size reads of non-input tensors; returns how many were rewritten."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if not placeholders:
        return 0
    batch_node: fx.Node | None = None
    rewritten = 0
    for node in list(graph.nodes):
        found = _size_dim(node)
        if found is None or not isinstance(found[0], fx.Node) or found[0].op == "placeholder":
            continue
        source, dim = found
        if source.meta.get("varuna_bounded_size"):
            continue  # its size depends on values (nonzero): only its bound is known
        outputs = info(source).outputs
        if len(outputs) != 1:
            continue
        shape = outputs[0].shape
        if dim is None:  # x.size() / x.shape: rewrite each x.size()[i]
            users = list(node.users)
            if not all(u.op == "call_function" and u.target is operator.getitem
                       and isinstance(u.args[1], int) for u in users):
                continue
            targets = [(u, shape[u.args[1]]) for u in users]
        else:
            targets = [(node, shape[dim])]
        if batch_node is None:
            with graph.inserting_after(placeholders[-1]):
                batch_node = graph.call_method("size", (placeholders[0], 0))
            info(batch_node).is_tensor = False
        for target, expr in targets:
            with graph.inserting_before(target):
                value = _expression(graph, batch_node, expr)
            for user in list(target.users):
                user.args = map_arg(user.args, lambda a, t=target, v=value: v if a is t else a)
                user.kwargs = map_arg(user.kwargs,
                                      lambda a, t=target, v=value: v if a is t else a)
            rewritten += 1
        for dead in [t for t, _ in targets if t is not node] + [node]:
            if not dead.users:
                graph.erase_node(dead)
    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten


def _expression(graph: fx.Graph, batch: fx.Node, expr: sympy.Expr) -> int | fx.Node:
    """``const + per_sample * b`` as an int, or as nodes computing it from the batch size."""
    expr = sympy.sympify(expr)
    per_sample = int(expr.coeff(b))
    const = int(expr.subs(b, 0))
    if per_sample == 0:
        return const
    value: fx.Node = batch
    if per_sample != 1:
        value = graph.call_function(operator.mul, (value, per_sample))
        info(value).is_tensor = False
    if const:
        value = graph.call_function(operator.add, (value, const))
        info(value).is_tensor = False
    return value
