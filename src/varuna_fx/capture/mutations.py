"""In-place operations: keep every side effect eager performs, and make its order explicit.

A statement such as ``y.relu_()``, ``mask.masked_fill_(m, 0)`` or ``self.calls.add_(1)``
has no user in an fx graph: dead-code elimination would drop it, and even when kept, nothing
orders it before the later reads of ``y``, so a stage split could run them in either order or
on different stages. Capture therefore

* keeps every mutating node (``is_mutating``) through dead-code elimination;
* rewrites later reads of the mutated value to read the mutating node instead (as
  torch.export's graphs already do), so the dependency is a graph edge the partitioner sees.
  ``x[i] = v`` (``operator.setitem``, which returns None) becomes ``setitem_value`` returning
  ``x`` for this purpose;
* marks the node (``NodeInfo.mutates``): ``mark_replicable`` never copies it into several
  stages, and a stage that mutates clones what it receives (``split_stages``), since a received
  activation is an autograd leaf and the recompute stash must stay as it arrived.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ..ir.nodes import info

_INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.imatmul, operator.setitem,
}


# views of their first input (fx call_method / call_function forms); in-place ops return it
VIEW_METHODS = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t",
                "select", "narrow", "expand", "expand_as", "squeeze", "unsqueeze", "flatten",
                "unflatten", "unbind", "split", "chunk", "__getitem__", "as_strided", "diagonal",
                "movedim", "swapaxes", "detach", "contiguous"}


def after_write(base: Any, write: Any) -> Any:
    """``base``, read after ``write`` wrote into a view of it (``h[:, 0] = 0`` as torch.export
    records it: ``fill_(select(h))``): the graph edge that orders later reads of ``h`` after
    the write, and sends ``h`` to later stages only once written."""
    return base


def setitem_value(base: Any, index: Any, value: Any) -> Any:
    """``base[index] = value``, returning ``base`` so later reads can depend on the write."""
    base[index] = value
    return base


def is_mutating(node: fx.Node, root: torch.nn.Module) -> bool:
    """Whether the node writes into one of its inputs (or a module's state)."""
    if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
        return bool(hop_written_inputs(node, root))
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_function":
        target = node.target
        if target in _INPLACE_OPERATORS or target is setitem_value:
            return True
        if isinstance(target, torch._ops.OpOverload):
            return target._schema.is_mutable
        if node.kwargs.get("inplace") is True:  # F.relu(x, inplace=True)
            return True
        name = getattr(target, "__name__", "")
        return name.endswith("_") and not name.endswith("__") and \
            getattr(target, "__module__", "") in ("torch", "torch._C._VariableFunctions")
    if node.op == "call_module":
        module = root.get_submodule(str(node.target))
        return getattr(module, "inplace", False) is True or \
            any(True for _ in module.buffers(recurse=True))
    return False


def hop_written_inputs(node: fx.Node, root: torch.nn.Module) -> list[fx.Node]:
    """The inputs a higher-order op writes in place inside its subgraph. torch.export puts a
    ``torch.no_grad()`` block into ``wrap_with_set_grad_enabled(False, submod, *inputs)``, so
    ``self.ema.mul_(0.9).add_(v)`` in such a block is a write into an input of ``submod``; if
    the op's result is unused, dead-code elimination dropped the write."""
    sub = next((a for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"
                and isinstance(_attribute(root, str(a.target)), fx.GraphModule)), None)
    if sub is None:
        return []
    module = _attribute(root, str(sub.target))
    operands = [a for a in node.args[node.args.index(sub) + 1:]]
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    written = set()
    for inner in module.graph.nodes:
        if inner.op != "placeholder" and is_mutating(inner, module):
            for base in written_arguments(inner):
                while isinstance(base, fx.Node) and base not in placeholders \
                        and aliases_first_input(base):
                    base = base.args[0]  # views and earlier writes of the same tensor
                if base in placeholders:
                    written.add(placeholders.index(base))
    return [operands[i] for i in sorted(written)
            if i < len(operands) and isinstance(operands[i], fx.Node)]


def aliases_first_input(node: fx.Node) -> bool:
    """Whether ``node``'s value is (a view of, or an in-place write into) its first input:
    the chain from a write back to the buffer it writes goes only through such nodes (an
    ``add_`` on ``F.embedding(ids, weight)`` writes an activation, not the weight)."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return False
    target = node.target
    if node.op == "call_method":
        name = str(target)
        return name in VIEW_METHODS or (name.endswith("_") and not name.endswith("__"))
    if node.op != "call_function":
        return False
    if isinstance(target, torch._ops.OpOverload):
        returns = target._schema.returns
        return bool(returns) and returns[0].alias_info is not None
    if target is operator.getitem or getattr(target, "__name__", "") == "setitem_value":
        return True
    if target is getattr:  # fx's `w.data`
        return len(node.args) > 1 and node.args[1] == "data"
    name = getattr(target, "__name__", "")
    return name in VIEW_METHODS or (name.endswith("_") and not name.endswith("__"))


def written_arguments(node: fx.Node) -> list[Any]:
    """The arguments an in-place node writes: by its schema for an aten op
    (``mv.out(self, vec, *, out)`` writes ``out``, not its first argument), else the first."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return [node.args[0]] if node.args else []
    written = []
    for i, argument in enumerate(node.target._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written.append(node.args[i] if i < len(node.args) and not argument.kwarg_only
                           else node.kwargs.get(argument.name))
    return written


def _attribute(root: torch.nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def _returns_its_first_input(node: fx.Node) -> bool:
    """``x.relu_()`` returns ``x`` written; aten's ``_native_batch_norm_legit`` writes its
    running statistics but returns new tensors, so reads of its input are not rewired."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        first = schema.arguments[0].alias_info if schema.arguments else None
        back = schema.returns[0].alias_info if schema.returns else None
        return bool(first and first.is_write and back and back.is_write
                    and first.before_set == back.before_set)
    return True


def place_write_backs(gm: fx.GraphModule) -> None:
    """torch.export writes a buffer that forward rebinds or updates (``self.steps += 1``,
    ``self.ema = ...``) back with ``copy_(buffer, new)`` at the very end of the graph. There it
    pinned the last stage to hold the buffer and, with a write in place early on, forbade every
    cut in between. Each write-back moves to right after the new value and the last read of
    the buffer before it; one that copies a buffer onto itself (the value is the buffer, written
    in place) is dropped."""
    graph = gm.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.copy_.default \
                or node.users or len(node.args) < 2:
            continue
        buffer, value = node.args[0], node.args[1]
        if not (isinstance(buffer, fx.Node) and buffer.op == "get_attr"
                and isinstance(value, fx.Node)):
            continue
        if _aliases(value, buffer):
            graph.erase_node(node)
            continue
        after = max([value, *(u for u in buffer.users if u is not node)], key=position.get)
        if position[after] < position[node] - 1:
            after.append(node)
    gm.recompile()


def _aliases(value: fx.Node, buffer: fx.Node) -> bool:
    """Whether ``value`` is ``buffer`` written in place (``add_(buffer, 1)``)."""
    while isinstance(value, fx.Node) and value is not buffer and value.op == "call_function" \
            and isinstance(value.target, torch._ops.OpOverload) and value.args \
            and _returns_its_first_input(value) and value.target._schema.is_mutable:
        value = value.args[0]
    return value is buffer


def _order_reads_of_viewed(graph: fx.Graph, write: fx.Node,
                           position: dict[fx.Node, int]) -> None:
    """A write into a view (``h[:, 0] = 0``, ``h.narrow(1, 0, 2).mul_(0)``) writes the tensors
    viewed: later reads of each read ``after_write(h, write)``. Without that edge nothing
    ordered them after the write: a stage sent ``h`` as it was before it, or a later stage read
    it first. A buffer's writes stay on the one stage that holds it, in graph order. The
    partition keeps the views, the write and these reads on one stage (``view_write_chain``):
    a view sent to another stage arrives as a tensor of its own, and a write into it would
    reach nothing."""
    viewed = view_write_chain(write)[1:]
    if viewed[-1].op == "get_attr":
        return
    for base in viewed[1:]:  # reads of viewed[0], the view written, now read `write`
        later = [u for u in base.users if position.get(u, -1) > position[write]]
        if not later:
            continue
        with graph.inserting_after(write):
            written = graph.call_function(after_write, (base, write))
        written.meta = {k: v for k, v in base.meta.items() if k != "varuna"}
        for user in later:
            user.replace_input_with(base, written)


def view_write_chain(write: fx.Node) -> list[fx.Node]:
    """``write``, the views it writes through and the tensor they view: ``[fill_, select,
    slice, h]`` for ``h[:, 0] = 0``; ``[write, h]`` for a write into ``h`` itself."""
    chain = [write]
    base = write.args[0] if write.args else None
    while isinstance(base, fx.Node):
        chain.append(base)
        if not _is_view(base):
            break
        base = base.args[0]
    return chain


def _is_view(node: Any) -> bool:
    """Whether ``node`` is a view of its first input (and writes nothing)."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    target = node.target
    if node.op == "call_method":
        return str(target) in VIEW_METHODS
    if node.op != "call_function":
        return False
    if isinstance(target, torch._ops.OpOverload):
        returns = target._schema.returns
        alias = returns[0].alias_info if returns else None
        return alias is not None and not alias.is_write
    return target is operator.getitem or getattr(target, "__name__", "") in VIEW_METHODS


def keep_mutations(gm: fx.GraphModule) -> None:
    """Dead-code elimination that keeps mutations, with reads after a mutation rewired."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is operator.setitem:
            node.target = setitem_value
    position = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if not is_mutating(node, gm):
            continue
        if node.op == "call_module" and not getattr(gm.get_submodule(str(node.target)),
                                                    "inplace", False):
            continue  # writes only its own state (BatchNorm): the output is a new tensor
        info(node).mutates = True
        base = node.args[0] if node.args else None
        if not isinstance(base, fx.Node) or not _returns_its_first_input(node):
            continue
        for user in list(base.users):
            if user is not node and position[user] > position[node]:
                user.replace_input_with(base, node)
        if _is_view(base):
            _order_reads_of_viewed(graph, node, position)
    graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or is_mutating(n, gm)
                              or _is_dropout_module(n, gm))
    gm.recompile()


_RANDOM_FUNCTIONS = frozenset({  # random, yet not impure to fx (torch.rand_like & co are)
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
    "feature_alpha_dropout", "rrelu"})


def _is_dropout_module(node: fx.Node, gm: fx.GraphModule) -> bool:
    """An unused ``self.drop(h)`` or ``F.dropout(h)`` stays, as an unused ``torch.rand_like``
    does (fx calls those impure): eager runs its draw, and random ops are numbered in the order
    eager runs them (ir/rng.py), so dropping one would shift every later op's key."""
    if node.op == "call_module":
        return "Dropout" in type(gm.get_submodule(str(node.target))).__name__
    return node.op == "call_function" and \
        getattr(node.target, "__name__", "") in _RANDOM_FUNCTIONS and \
        getattr(node.target, "__module__", "") in ("torch.nn.functional", "torch")
