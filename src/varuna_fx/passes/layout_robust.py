"""Stage graphs whose views hold for any layout of their inputs.

A ``view`` works only on a tensor whose strides allow it, and the captured graph saw one
layout: the example's, in one forward on the whole batch. The stages run on others: a received
activation arrives contiguous whatever the sender's strides were, micro-batches and keyed draws
are joined with ``torch.cat``, a recompute replays from the stash, and an attention may run
another backend (math instead of flash, whose output is a transposed layout). torch.export
also drops a ``.contiguous()`` that did nothing on the traced tensor, so
``y.transpose(1, 2).contiguous().view(B, T, C)`` is recorded as a bare ``view`` of the
transposed tensor, which fails as soon as that tensor is laid out otherwise ("view size is not
compatible with input tensor's size and stride").

So each shape ``view`` becomes ``reshape``: the same view (no copy) wherever a view is possible,
and a copy with the same values where it is not; gradients are the same. One exception keeps
its ``view``: where the graph writes in place into the view or into what it views, the aliasing
is the point (a copy would not see the write). A dtype view (``x.view(torch.int8)``) is no
shape view and stays.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..ir.nodes import info

# (op, target) of a shape view -> the reshape that replaces it
_FUNCTIONS = {
    torch.ops.aten.view.default: torch.ops.aten.reshape.default,
    torch.Tensor.view: torch.Tensor.reshape,
    torch.Tensor.view_as: torch.Tensor.reshape_as,
}
_METHODS = {"view": "reshape", "view_as": "reshape_as"}


def robust_views(graph: fx.Graph) -> int:
    """Turn ``graph``'s shape views into reshapes (in place); how many were turned."""
    turned = 0
    for node in graph.nodes:
        if not _shape_view(node) or _aliasing_written(node):
            continue
        if node.op == "call_method":
            node.target = _METHODS[str(node.target)]
        else:
            node.target = _FUNCTIONS[node.target]
        turned += 1
    return turned


def _shape_view(node: fx.Node) -> bool:
    if node.op == "call_method":
        known = node.target in _METHODS
    elif node.op == "call_function":
        known = node.target in _FUNCTIONS
    else:
        return False
    # x.view(torch.float16) reinterprets bytes: no reshape does that
    return known and not any(isinstance(a, torch.dtype) for a in (*node.args, *node.kwargs.values()))


def _aliasing_written(node: fx.Node) -> bool:
    """Whether a node writes in place into ``node`` or the tensor it views (or a view of them
    along a chain of views): then ``node`` must stay a view of it."""
    group: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in group:
            continue
        group.add(n)
        if _is_view_like(n) and n.args and isinstance(n.args[0], fx.Node):
            todo.append(n.args[0])
        todo.extend(u for u in n.users if _is_view_like(u))
    return any(info(u).mutates or _writes_in_place(u) for n in group for u in n.users)


def _is_view_like(node: fx.Node) -> bool:
    """An op whose result may alias its first argument."""
    if node.op == "call_method":
        return str(node.target) in {"view", "view_as", "reshape", "reshape_as", "transpose",
                                    "permute", "t", "unsqueeze", "squeeze", "flatten",
                                    "unflatten", "expand", "narrow", "select", "split",
                                    "chunk", "unbind", "contiguous", "__getitem__", "T", "mT"}
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.is_view or target._schema.name in {"aten::reshape", "aten::contiguous"}
    return getattr(target, "__name__", "") in {"getitem", "reshape", "flatten", "transpose",
                                                "permute", "unsqueeze", "squeeze", "narrow",
                                                "select", "split", "chunk", "unbind"}


def _writes_in_place(node: fx.Node) -> bool:
    """An in-place call (``x.add_(1)``, ``aten.add_.Tensor``, ``x += 1``) whatever capture
    flagged: cheap to recognise, and keeping a view costs nothing where it works."""
    target = node.target
    if node.op == "call_method":
        return str(target).endswith("_") and not str(target).startswith("__")
    if node.op != "call_function":
        return False
    if isinstance(target, torch._ops.OpOverload):
        return any(a.alias_info is not None and a.alias_info.is_write
                   for a in target._schema.arguments)
    name = getattr(target, "__name__", "")
    return name.startswith("i") and name in {"iadd", "isub", "imul", "itruediv", "ifloordiv",
                                             "ipow", "iand", "ior", "ixor", "imod"} or \
        (name.endswith("_") and not name.startswith("_"))
