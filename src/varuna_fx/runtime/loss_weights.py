"""Losses that are means over the targets a micro-batch keeps: weight micro-batches by them.

A pipeline's step loss is the mean of its micro-batches' losses, which equals eager's loss on the
whole batch only when every micro-batch's loss divides by the same count. A Hugging Face model's
loss (``cross_entropy(..., ignore_index=-100)``, reduction "mean") divides by the number of
targets that are not ``ignore_index`` in *that* micro-batch: with padded labels the counts
differ, and the plain mean over micro-batches is silently another number than eager's (with other
gradients). Whole batch: ``sum_i S_i / sum_i n_i``; mean of micro-batch means:
``mean_i (S_i / n_i)``.

``find_mean_loss`` looks, at compile, for such a loss call among the ancestors of the output the
step back-propagates, and cuts out the part of the graph that computes its target (and class
weights) from the inputs alone. At every step, ``MeanLoss.weights`` evaluates that cut on each
micro-batch and counts what the loss divides by (targets that are not ``ignore_index``, or
their class weights' sum). When the model's loss *is* that mean (through value-preserving ops
only), micro-batch i's loss is weighted by ``n_i / sum n`` instead of ``1/m``: exactly eager's
whole-batch mean. When the mean is mixed into the loss in another way (added to another term,
scaled), no weighting is exact: the step refuses micro-batches whose counts differ instead of
returning another loss than eager's. Equal counts need nothing (the plain mean is exact).

A ``loss_fn`` runs outside the graph, so it is not analysed: its output is averaged over
micro-batches as documented. Data-parallel replicas weight their own micro-batches and are
averaged as DDP does.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from ..capture.buffers import MicroBatchStateWarning
from ..errors import InputError
from ..passes.split_stages import output_key

_aten = torch.ops.aten

# value-preserving single-input ops between the mean loss and the model's output
_TRANSPARENT_FUNCTIONS = {
    _aten.to.dtype, _aten.to.dtype_layout, _aten.to.device, _aten.to.other, _aten._to_copy.default,
    _aten.clone.default, _aten.alias.default, _aten.contiguous.default, _aten.view.default,
    _aten.reshape.default, _aten.squeeze.default, torch.squeeze, torch.reshape,
}
_TRANSPARENT_METHODS = {"to", "float", "double", "half", "bfloat16", "clone", "contiguous",
                        "view", "reshape", "squeeze", "type_as"}


@dataclass(frozen=True)
class _MeanCall:
    """One mean-reduced loss call: where its target (and class weights) come from."""

    target: int  # index into the counting graph's outputs
    weight: int | None
    ignore_index: int
    where: str


@dataclass
class MeanLoss:
    """The loss's mean-over-kept-targets calls and how to count what they divide by."""

    counting: fx.GraphModule  # micro-batch inputs -> the calls' targets (and weights)
    inputs: list[str]
    calls: list[_MeanCall]
    exact: bool  # the loss is one such mean: weighting micro-batches is exactly eager's
    read: frozenset[str] = frozenset()  # the inputs the counting graph reads
    # with a loss_fn: the flat output that is this mean; micro-batches are weighted at a step
    # only where loss_fn returns that very tensor (``weighs``); None: the model's own loss
    leaf: int | None = None

    def weighs(self, loss: Any, outputs: dict[str, Any]) -> bool:
        """Whether ``loss`` (what the step back-propagates for a micro-batch) is this mean:
        always for the model's own loss; for a ``loss_fn``'s, when it returned the output
        itself (the last stage's ``outputs``, by identity), not something computed from it."""
        return self.leaf is None or loss is outputs.get(output_key(self.leaf))

    def counts(self, micro: dict[str, torch.Tensor]) -> list[torch.Tensor | None]:
        """What each call divides by on this micro-batch, as 0-d tensors where they are (None:
        a fixed count, e.g. class probabilities as targets)."""
        with torch.no_grad():
            # copies of what it reads: forward's own code may write them in place
            values = self.counting(*(micro[name].clone() if name in self.read else micro[name]
                                     for name in self.inputs))
            out: list[torch.Tensor | None] = []
            for call in self.calls:
                target = values[call.target]
                if not isinstance(target, torch.Tensor) or target.is_floating_point():
                    out.append(None)
                    continue
                kept = target != call.ignore_index
                if call.weight is None:
                    out.append(kept.sum().double())
                else:
                    out.append(values[call.weight][target[kept]].sum().double())
        return out

    def weights(self, micro: list[dict[str, torch.Tensor]]) -> list[float] | None:
        """Each micro-batch's share of the step's loss, or None when the plain mean over
        micro-batches is already exact (every count equal)."""
        tensors = [self.counts(mb) for mb in micro]
        present = [c for counts in tensors for c in counts if c is not None]
        if not present:
            return None
        numbers = iter(torch.stack(present).tolist())  # one device sync for the whole step
        per_mb = [[None if c is None else next(numbers) for c in counts] for counts in tensors]
        uneven = [j for j, call in enumerate(self.calls)
                  if len({counts[j] for counts in per_mb}) > 1]
        if not uneven:
            return None
        call = self.calls[uneven[0]]
        counts = [counts[uneven[0]] for counts in per_mb]
        if not self.exact:
            raise InputError(
                f"the loss averages over the targets that are not ignore_index "
                f"({call.ignore_index}) in {call.where}, and this batch's micro-batches keep "
                f"different numbers of them ({_numbers(counts)}); the loss mixes that mean with "
                "other terms, so no weighting of micro-batches equals the whole batch's loss. "
                "Give every micro-batch the same number of kept targets (or micro_batch_size = "
                "the batch size), or make that mean the model's whole loss (the step then "
                "weights each micro-batch by its count)"
            )
        total = sum(c for c in counts if c is not None)
        if total == 0:  # eager's mean over nothing is nan too; keep the plain mean
            return None
        return [c / total for c in counts]  # type: ignore[operator]


def _numbers(values: list[Any]) -> str:
    return ", ".join(f"{v:g}" for v in values)


def find_mean_loss(gm: fx.GraphModule, out_spec: pytree.TreeSpec, input_names: list[str],
                   loss_fn: Any) -> MeanLoss | None:
    """The mean-over-kept-targets calls the step's loss depends on, or None (none, or
    targets computed from more than the inputs). With a ``loss_fn``: the one output of the
    model that is exactly such a mean, weighted only at the steps where ``loss_fn`` returns
    that very output (``MeanLoss.leaf``; nanoGPT's ``(logits, loss)`` with ``loss_fn=lambda
    out, _: out[1]``); a ``loss_fn`` computing a loss of its own is not analysed."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaves = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else []
    if loss_fn is None:
        index = _loss_leaf(out_spec, len(leaves))
        if index is None or not isinstance(leaves[index], fx.Node):
            return None
        return _mean_loss_at(gm, leaves[index])
    exact = [(k, found) for k, leaf in enumerate(leaves) if isinstance(leaf, fx.Node)
             for found in [_mean_loss_at(gm, leaf)] if found is not None and found.exact]
    if len(exact) != 1:  # none, or several outputs a loss_fn could pick: nothing to say
        return None
    k, found = exact[0]
    return dataclasses.replace(found, leaf=k)


def _mean_loss_at(gm: fx.GraphModule, loss: fx.Node) -> MeanLoss | None:
    """The mean-over-kept-targets calls ``loss`` depends on (None: none, or targets the
    model computes)."""
    ancestors = _ancestors(loss)
    found = [(node, call) for node in gm.graph.nodes if node in ancestors
             for call in [_mean_call(gm, node)] if call is not None]
    if not found:
        return None
    wanted: list[fx.Node] = []
    calls = []
    for node, (target, weight, ignore_index) in found:
        if not _from_inputs_only(gm, target) or (weight is not None
                                                 and not _from_inputs_only(gm, weight)):
            return None  # targets computed by the model itself: nothing to count up front
        t = _index_of(wanted, target)
        w = None if weight is None else _index_of(wanted, weight)
        calls.append(_MeanCall(t, w, ignore_index, _where(node)))
    counting, inputs = _cut(gm, wanted)
    exact = len(found) == 1 and _through_transparent(loss) is found[0][0]
    read = frozenset(n.name for n in counting.graph.nodes if n.op == "placeholder" and n.users)
    return MeanLoss(counting, inputs, calls, exact, read)


def _loss_leaf(spec: pytree.TreeSpec, count: int) -> int | None:
    """Which flat output is the loss, found as ``runtime/batching.extract_loss`` finds it."""
    try:
        tree = pytree.tree_unflatten(list(range(count)), spec)
    except Exception:  # noqa: BLE001 - an output type that will not hold ints: no analysis
        return None
    if isinstance(tree, int):
        return tree
    loss = getattr(tree, "loss", None)
    if loss is None and isinstance(tree, dict):
        loss = tree.get("loss")
    return loss if isinstance(loss, int) else None


def _mean_call(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.Node, fx.Node | None, int] | None:
    """(target, weight, ignore_index) of a cross-entropy / NLL call reduced by "mean"."""
    if node.op == "call_function" and node.target in (_aten.cross_entropy_loss.default,
                                                      _aten.nll_loss.default,
                                                      _aten.nll_loss_nd.default):
        names = ("self", "target", "weight", "reduction", "ignore_index")
        defaults = {"weight": None, "reduction": 1, "ignore_index": -100}
        args = {**defaults, **dict(zip(names, node.args)), **node.kwargs}
        if args["reduction"] != 1:  # at::Reduction::Mean
            return None
    elif node.op == "call_function" and node.target in (nn.functional.cross_entropy,
                                                        nn.functional.nll_loss):
        names = ("input", "target", "weight", "size_average", "ignore_index", "reduce",
                 "reduction")
        defaults = {"weight": None, "size_average": None, "reduce": None,
                    "ignore_index": -100, "reduction": "mean"}
        args = {**defaults, **dict(zip(names, node.args)), **node.kwargs}
        if args["size_average"] is not None or args["reduce"] is not None \
                or args["reduction"] != "mean":
            return None
    elif node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if type(module) not in (nn.CrossEntropyLoss, nn.NLLLoss) or module.reduction != "mean":
            return None
        args = {"target": node.args[1] if len(node.args) > 1 else node.kwargs.get("target"),
                "weight": None, "ignore_index": module.ignore_index}
        if module.weight is not None:
            return None  # a buffer of the module: not a graph value we can cut out
    else:
        return None
    target, weight = args["target"], args["weight"]
    if not isinstance(target, fx.Node) or not isinstance(args["ignore_index"], int) \
            or (weight is not None and not isinstance(weight, fx.Node)):
        return None
    return target, weight, args["ignore_index"]


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        for parent in todo.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen | {node}


def _from_inputs_only(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` is computed from the inputs and constants only (no parameter, no
    module call, nothing random), so it can be evaluated before the step."""
    params = {name for name, _ in gm.named_parameters()}
    for n in _ancestors(node):
        if n.op == "call_module":
            return False
        if n.op == "get_attr" and str(n.target) in params:
            return False
        if n.op == "call_function" and _random(n.target):
            return False
    return True


def _random(target: Any) -> bool:
    name = str(getattr(target, "__name__", target))
    return any(word in name for word in ("rand", "dropout", "bernoulli", "normal", "multinomial"))


def _index_of(wanted: list[fx.Node], node: fx.Node) -> int:
    if node not in wanted:
        wanted.append(node)
    return wanted.index(node)


def _cut(gm: fx.GraphModule, wanted: list[fx.Node]) -> tuple[fx.GraphModule, list[str]]:
    """A graph of the inputs computing ``wanted`` (placeholders kept in order, even unused,
    so it is called with the micro-batch's inputs positionally)."""
    keep: set[fx.Node] = set()
    for node in wanted:
        keep |= _ancestors(node)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            inputs.append(node.name)
            env[node] = graph.placeholder(node.name)
        elif node in keep:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in wanted))
    return fx.GraphModule(gm, graph, "CountKeptTargets"), inputs


def _through_transparent(node: fx.Node) -> fx.Node:
    """Back from the model's loss output through value-preserving ops."""
    while True:
        if node.op == "call_function" and node.target in _TRANSPARENT_FUNCTIONS \
                or node.op == "call_method" and node.target in _TRANSPARENT_METHODS:
            parent = node.args[0]
        else:
            return node
        if not isinstance(parent, fx.Node):
            return node
        node = parent


def _where(node: fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in trace.splitlines() if line.strip().startswith("File")]
    return f"{node.name} ({lines[-1]})" if lines else node.name


def warn_uneven_ignored_targets(targets: list[Any]) -> bool:
    """Warn when the micro-batches' targets hold different numbers of negative labels (what
    ``cross_entropy``'s ``ignore_index`` names: -100 by default, -1 in nanoGPT; no class index
    is negative): a ``loss_fn`` averaging over the others is not weighted (it runs outside the
    graph), so its mean over micro-batches would differ from eager's. Returns whether it warned
    (once per pipeline is enough)."""
    per_mb = [[t for t in pytree.tree_leaves(target) if isinstance(t, torch.Tensor)
               and t.dim() > 0 and not t.is_floating_point() and not t.is_complex()]
              for target in targets]
    if not per_mb or not per_mb[0]:
        return False
    with torch.no_grad():
        counts = torch.stack([torch.stack([(t < 0).sum() for t in leaves])
                              for leaves in per_mb]).tolist()  # one device sync
    if all(c == counts[0] for c in counts) or not any(map(any, counts)):
        return False
    warnings.warn(
        "the step's targets hold different numbers of negative labels (an ignore_index of "
        "cross_entropy: -100 by default, -1 in nanoGPT) per micro-batch "
        f"({', '.join(str(sum(c)) for c in counts)}): if loss_fn averages over "
        "the other labels, the pipeline's mean over micro-batches differs from eager's loss on "
        "the whole batch (micro-batches are not weighted by their counts for a loss_fn). "
        "Return the loss from the model (it is weighted), use reduction='sum' divided by the "
        "whole batch's count, or micro_batch_size equal to the batch",
        MicroBatchStateWarning, stacklevel=4)
    return True
