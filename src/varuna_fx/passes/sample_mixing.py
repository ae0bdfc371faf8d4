"""Computation that mixes samples along the batch dimension, which micro-batching changes.

A pipeline runs each micro-batch through the model on its own. That equals eager on the whole
batch only when every sample's result depends on that sample alone, or when what mixes samples
is a mean that reaches the loss linearly (the mean of equal micro-batches' means is the
batch's mean). Anything else silently becomes a statistic over each micro-batch:

* a statistic over the batch fed back into per-sample values: ``h - h.mean(0)``,
  ``F.batch_norm(..., training=True)``, dynamically quantised layers (one activation scale
  per call);
* a batch x batch product: ``a @ b.T`` of two batches (in-batch contrastive losses);
* values that depend on the batch size: ``h + torch.arange(h.shape[0])``;
* a sum over the batch reaching the loss (``h.sum(0)``), or a non-linear function of a mean
  over it; the warning says which.

The analysis is a pure function over a small list of operations (``Op``): which values each
reads and writes, how many dimensions of each scale with the batch, and what kind of
operation it is. ``ops_of_graph`` builds that list from a captured graph's shape annotations
(``annotate_shapes`` ran the graph at two batch sizes); ``runtime/loss_fn_mixing.py`` builds it
from a ``loss_fn`` run on fake tensors. ``mark_sample_mixing`` writes each finding into the
node's ``NodeInfo.mixes_samples``; ``warn_sample_mixing`` warns once per compile when more than
one micro-batch runs, naming the source line (as for BatchNorm).
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..capture.buffers import MicroBatchStateWarning
from ..capture.inputs import BoundInputs
from ..errors import InputError
from ..ir.nodes import b, info
from .sample_probe import REASON as PROBE_REASON
from .sample_probe import probe_sample_mixing

_aten = torch.ops.aten

# what kind of operation a node is, for the analysis
MEAN = "mean"  # reduces by a mean: exact over equal micro-batches when it reaches the loss linearly
LINEAR = "linear"  # value-preserving or linear in each input (add, scale by a constant, view, ...)
PRODUCT = "product"  # linear in each input, not jointly (mul, div): a constant factor stays linear
POSITIONAL = "positional"  # values that depend on their size (arange)
INDEX = "index"  # indexes its first input with the others (getitem, aten.index)
ITEM = "item"  # one leaf of a tuple-valued op's result: that op is judged, not this
TEMPLATE = "template"  # reads only its input's dtype/device/shape (new_ones, size)
BATCH_STATS = "batch_stats"  # normalises by the batch's own statistics (batch_norm training)
QUANTIZED = "quantized"  # dynamic quantisation: one activation scale over the whole input
OTHER = "other"

_MEAN_FUNCTIONS = {torch.mean, _aten.mean.default, _aten.mean.dim, _aten.mean.dtype_out}
_LOSS_FUNCTIONS = {
    nn.functional.cross_entropy, nn.functional.nll_loss, nn.functional.mse_loss,
    nn.functional.l1_loss, nn.functional.smooth_l1_loss, nn.functional.huber_loss,
    nn.functional.binary_cross_entropy, nn.functional.binary_cross_entropy_with_logits,
    nn.functional.kl_div, nn.functional.soft_margin_loss, nn.functional.cosine_embedding_loss,
}
_ATEN_LOSSES = {  # reduction: at::Reduction::Mean is 1
    # cross_entropy_loss(self, target, weight, reduction, ignore_index, label_smoothing)
    _aten.cross_entropy_loss.default: 3, _aten.nll_loss.default: 3,
    _aten.nll_loss_nd.default: 3, _aten.nll_loss_forward.default: 3,
    _aten.mse_loss.default: 2, _aten.l1_loss.default: 2, _aten.smooth_l1_loss.default: 2,
    _aten.huber_loss.default: 2, _aten.binary_cross_entropy.default: 3,
    _aten.binary_cross_entropy_with_logits.default: 4, _aten.kl_div.default: 2,
    _aten.soft_margin_loss.default: 2,
}
_LOSS_MODULES = (nn.CrossEntropyLoss, nn.NLLLoss, nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss,
                 nn.HuberLoss, nn.BCELoss, nn.BCEWithLogitsLoss, nn.KLDivLoss)
_LINEAR_NAMES = {
    "add", "sub", "rsub", "neg", "sum", "mean", "to", "float", "double", "half", "bfloat16",
    "type_as", "clone", "contiguous", "view", "reshape", "squeeze", "unsqueeze", "flatten",
    "expand", "alias", "_to_copy", "detach", "lift_fresh_copy", "t", "transpose", "permute",
    "getitem", "select", "slice", "copy", "iadd", "isub", "pos", "squeeze_", "unsqueeze_",
}
_PRODUCT_NAMES = {"mul", "div", "truediv", "true_divide", "imul", "itruediv"}
_POSITIONAL_NAMES = {"arange", "linspace", "logspace", "randperm", "eye", "range"}
# ops that move rows by indices (a mixture of experts sorts tokens by expert and scatters them
# back): positions used only through them keep each sample's values its own
_INDEXING_NAMES = {"index_add", "index_copy", "index_put", "index_fill", "scatter",
                   "scatter_add", "scatter_reduce", "gather", "take", "take_along_dim", "sort",
                   "argsort", "index_select", "repeat_interleave"}
# counts over the batch (tokens per expert) that steer bookkeeping, not values
_COUNT_NAMES = {"histc", "bincount"}
_TEMPLATE_NAMES = {"new_ones", "new_zeros", "new_full", "new_empty", "new_empty_strided",
                   "new_tensor", "zeros_like", "ones_like", "empty_like", "full_like", "size",
                   "sym_size", "dim", "numel", "sym_numel", "rand_like", "randn_like",
                   "randint_like"}
_BATCH_NORM = {_aten.batch_norm.default, _aten.native_batch_norm.default,
               _aten._native_batch_norm_legit.default,
               _aten._native_batch_norm_legit_functional.default,
               _aten._native_batch_norm_legit_no_training.default,
               _aten.cudnn_batch_norm.default, nn.functional.batch_norm, torch.batch_norm}


@dataclass(frozen=True)
class Op:
    """One operation: the values it reads and the one it writes, with how many dimensions of
    each scale with the batch (-1: not a tensor, or unknown)."""

    name: str  # for messages (the node's name)
    kind: str
    inputs: tuple[int, ...]  # value ids
    output: int
    input_batch_dims: tuple[int, ...]
    output_batch_dims: int
    where: str = ""  # the user's source line
    index_first: bool = False  # INDEX: indexes dim 0 with the batch-sized values
    # its value is an integer or bool tensor: a count or a mask over the batch (which experts
    # any token chose, in a mixture of experts) steers bookkeeping, not per-sample values
    counts: bool = False


@dataclass
class Finding:
    op: str  # the Op's name
    reason: str
    where: str


@dataclass
class _Value:
    batch: bool = False  # depends on the batch's samples
    producer: Op | None = None
    users: list[Op] = field(default_factory=list)


def find_sample_mixing(ops: Sequence[Op], outputs: Sequence[int]) -> list[Finding]:
    """The operations whose result micro-batching changes, in the order they run."""
    values: dict[int, _Value] = {}
    for op in ops:
        for v, dims in zip(op.inputs, op.input_batch_dims):
            value = values.setdefault(v, _Value())
            value.users.append(op)
            value.batch = value.batch or dims > 0  # (model inputs are no op's output)
        out = values.setdefault(op.output, _Value())
        out.producer = op
        out.batch = op.output_batch_dims > 0 or op.kind != TEMPLATE and \
            any(values[v].batch for v in op.inputs)
    found: list[Finding] = []
    for op in ops:
        reason = _reason(op, values, set(outputs))
        if reason:
            found.append(Finding(op.name, reason, op.where))
    return found


def _reason(op: Op, values: dict[int, _Value], outputs: set[int]) -> str:
    batched_in = [d for d in op.input_batch_dims if d > 0]
    if op.kind == BATCH_STATS and batched_in:
        return "normalises with the batch's own statistics (batch_norm in training mode)"
    if op.kind == QUANTIZED and batched_in:
        return "quantises its input dynamically, with one scale over the whole input"
    if op.output_batch_dims >= 2 and all(d < 2 for d in op.input_batch_dims):
        return "multiplies samples with samples (a batch x batch result)"
    if op.kind == POSITIONAL and op.output_batch_dims > 0 and not batched_in:
        if not _only_indexes_the_batch(op, values):
            return "makes values that depend on the batch size (arange over the batch)"
        return ""
    if op.output_batch_dims != 0 or not batched_in or op.kind in (ITEM, TEMPLATE) or op.counts:
        return ""
    # the batch dimension disappears here: a statistic over samples (or a pick of some)
    down = _downstream(op, values)
    if op.output not in outputs and not down:
        return ""  # only its shape is used (randn_like(h[:1])), or nothing is
    if op.kind == INDEX:
        return "picks samples by their position in the batch"
    if any(d.output_batch_dims > 0 for d in down):
        return "computes a statistic over the batch that per-sample values then use"
    if op.kind == MEAN and all(_linear_after(d, values) for d in down):
        return ""  # a mean reaching the outputs linearly: the micro-batches' mean is eager's
    if op.output not in outputs and not any(d.output in outputs for d in down):
        return ""  # feeds nothing the step returns
    return _reduction_reason(op, down, values)


def _reduction_reason(op: Op, down: list[Op], values: dict[int, _Value]) -> str:
    """Why a reduction over the batch that reaches the outputs is not exact, by what it is."""
    if op.kind == MEAN:
        after = next((d.name for d in down if not _linear_after(d, values)), "")
        through = f" (through {after})" if after else ""
        return (f"takes a mean over the batch ({op.name}) that reaches the step's outputs "
                f"non-linearly{through}, so a function of each micro-batch's mean is not the "
                "function of the whole batch's")
    if op.kind == LINEAR:
        return (f"sums over the batch ({op.name}): the step averages its micro-batches' "
                "results, so a sum over samples is not the whole batch's (a mean would be)")
    return (f"reduces over the batch ({op.name}, not by a mean), so each micro-batch's result "
            "differs from the whole batch's")


def _downstream(op: Op, values: dict[int, _Value]) -> list[Op]:
    """Every op that uses ``op``'s values, directly or through others (an op that reads only
    a shape, ``randn_like``, uses none of them)."""
    seen: dict[int, Op] = {}
    todo = [op.output]
    while todo:
        for user in values[todo.pop()].users:
            if id(user) not in seen and user.kind != TEMPLATE:
                seen[id(user)] = user
                todo.append(user.output)
    return list(seen.values())


def _linear_after(op: Op, values: dict[int, _Value]) -> bool:
    """Whether ``op`` keeps a mean of the batch a mean: a linear op, or a product with
    factors that do not depend on the samples (at most one batch-dependent factor)."""
    if op.kind in (LINEAR, MEAN, ITEM):
        return True
    if op.kind == PRODUCT:
        return sum(values[v].batch for v in op.inputs) <= 1 or \
            (op.name.startswith(("div", "truediv")) and not values[op.inputs[-1]].batch)
    return False


def _only_indexes_the_batch(op: Op, values: dict[int, _Value]) -> bool:
    """``logits[torch.arange(b), last]``: positions used only to index the batch dimension
    pick each sample's own row, in any micro-batch."""
    todo, seen = [op.output], set()
    while todo:
        v = todo.pop()
        for user in values[v].users:
            if user.kind == INDEX:
                continue  # used to pick, sort or scatter rows, not as values
            if user.kind in (LINEAR, ITEM) and id(user) not in seen:
                seen.add(id(user))
                todo.append(user.output)
                continue
            return False
    return True


# -- a captured graph as Ops -------------------------------------------------------------------


def _batch_dims(node: Any) -> int:
    if not isinstance(node, fx.Node):
        return -1
    outputs = info(node).outputs
    if not outputs or not info(node).is_tensor and len(outputs) == 0:
        return -1
    return max(sum(1 for d in t.shape if getattr(d, "has", None) and d.has(b)) for t in outputs)


def _name_of(target: Any) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return target._overloadpacket.__name__
    return str(getattr(target, "__name__", target)).strip("_")


def _kind(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if type(module).__module__.startswith("torch.ao.nn.quantized.dynamic"):
            return QUANTIZED
        if isinstance(module, _LOSS_MODULES):
            return MEAN if getattr(module, "reduction", "mean") == "mean" else OTHER
        if isinstance(module, (nn.Identity, nn.Flatten, nn.Unflatten)):
            return LINEAR
        return OTHER
    return kind_of_call(node.target, node.args, node.kwargs)


def kind_of_call(target: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    """The kind of a function call (a torch function, a method name or an aten overload)."""
    if target is _aten._native_batch_norm_legit_no_training.default:
        return OTHER
    if target in _BATCH_NORM:  # (input, 4 tensors, training, ...) in every variant
        training = kwargs.get("training", args[5] if len(args) > 5 else False)
        return BATCH_STATS if training else OTHER
    if target in _MEAN_FUNCTIONS:
        return MEAN
    if target in _LOSS_FUNCTIONS:
        return MEAN if kwargs.get("reduction", "mean") == "mean" else OTHER
    if target in _ATEN_LOSSES:
        at = _ATEN_LOSSES[target]
        reduction = args[at] if len(args) > at else kwargs.get("reduction", 1)
        return MEAN if reduction == 1 else OTHER
    name = _name_of(target).rstrip("_")  # in-place variants (index_put_) as their op
    if "dynamic" in name and ("quantize" in name or "linear" in name):
        return QUANTIZED
    if name in ("getitem", "index") or name in _INDEXING_NAMES or target is operator.getitem:
        return INDEX
    if name == "mean":
        return MEAN
    if name in _POSITIONAL_NAMES:
        return POSITIONAL
    if name in _TEMPLATE_NAMES:
        return TEMPLATE
    if name in _PRODUCT_NAMES:
        return PRODUCT
    if name in _LINEAR_NAMES:
        return LINEAR
    return OTHER


def _indexes_dim0(node: fx.Node, dims: Callable[[Any], int]) -> bool:
    """An indexing node whose index into dim 0 is a tensor (``x[idx, ...]``, aten.index)."""
    index = node.args[1] if len(node.args) > 1 else None
    first = index[0] if isinstance(index, (tuple, list)) and index else index
    return isinstance(first, fx.Node) and dims(first) >= 0


def ops_of_graph(gm: fx.GraphModule, model: nn.Module | None = None,
                 dims: Callable[[Any], int] | None = None,
                 tuple_valued: Callable[[fx.Node], bool] | None = None,
                 ) -> tuple[list[Op], list[int]]:
    """The graph's compute nodes as Ops (value id = node position), and the ids of the values
    the graph returns. ``model``: the user's model (names nn.BatchNorm modules that
    torch.export turned into aten calls). ``dims``: how many dimensions of a node's tensor
    value scale with the batch, -1 for a non-tensor (default: from ``annotate_shapes``);
    ``tuple_valued``: whether a node's value is a tuple of tensors (default: likewise)."""
    dims = dims or _batch_dims
    tuple_valued = tuple_valued or (lambda n: not info(n).is_tensor and len(info(n).outputs) > 1)
    ids = {node: k for k, node in enumerate(gm.graph.nodes)}
    ops: list[Op] = []
    outputs: list[int] = []
    for node in gm.graph.nodes:
        if node.op == "output":
            outputs = [ids[n] for n in node.all_input_nodes]
            continue
        if node.op in ("placeholder", "get_attr"):
            continue
        inputs = node.all_input_nodes
        kind = _kind(gm, node)
        if kind == INDEX and isinstance(node.args[0], fx.Node) and tuple_valued(node.args[0]):
            kind = ITEM
        if kind == BATCH_STATS and _is_batch_norm_module(model or gm, info(node).module_path):
            kind = OTHER  # nn.BatchNorm under torch.export: its own warning names the module
        ops.append(Op(
            name=node.name, kind=kind, inputs=tuple(ids[i] for i in inputs), output=ids[node],
            input_batch_dims=tuple(dims(i) for i in inputs), output_batch_dims=dims(node),
            where=info(node).source, index_first=kind == INDEX and _indexes_dim0(node, dims),
            counts=_name_of(node.target) in _COUNT_NAMES or bool(info(node).outputs) and not any(
                o.dtype.is_floating_point or o.dtype.is_complex for o in info(node).outputs),
        ))
    return ops, outputs


def _batch_norm(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A batch norm in training mode, as a module call or an aten/functional call."""
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), nn.modules.batchnorm._BatchNorm)
    return node.op == "call_function" and \
        kind_of_call(node.target, node.args, node.kwargs) == BATCH_STATS


def _is_batch_norm_module(root: nn.Module, path: str) -> bool:
    try:
        return bool(path) and isinstance(root.get_submodule(path),
                                         nn.modules.batchnorm._BatchNorm)
    except AttributeError:
        return False


def mark_sample_mixing(gm: fx.GraphModule, model: nn.Module | None = None,
                       bound: BoundInputs | None = None) -> None:
    """Write why each node mixes samples into ``NodeInfo.mixes_samples`` ("" where it does
    not): the rules over the ops, then, with the example inputs (``bound``), what the graph
    computes on a few of them (``sample_probe.py``)."""
    for node in gm.graph.nodes:
        info(node).mixes_samples = ""
    ops, outputs = ops_of_graph(gm, model)
    nodes = {node.name: node for node in gm.graph.nodes}
    for finding in find_sample_mixing(ops, outputs):
        info(nodes[finding.op]).mixes_samples = finding.reason
    if bound is not None:
        # (a draw whose layout is refused when the batch is split is not warned about too,
        # nor BatchNorm, which capture/buffers.py warns about by its module's name)
        found = {n.name for n in gm.graph.nodes if info(n).mixes_samples or
                 info(n).random_layout or _batch_norm(gm, n)}
        for node in probe_sample_mixing(gm, bound, found):
            info(node).mixes_samples = PROBE_REASON


def warn_sample_mixing(what: str, findings: Sequence[Finding], num_micro_batches: int,
                       stacklevel: int = 3) -> None:
    """One warning naming where samples mix, when more than one micro-batch runs."""
    if num_micro_batches <= 1 or not findings:
        return
    first = findings[0]
    more = f" (and {len(findings) - 1} more)" if len(findings) > 1 else ""
    warnings.warn(
        f"{what} {first.reason}{' at ' + first.where if first.where else ''}{more}, and the "
        f"plan splits each batch into {num_micro_batches} micro-batches: it is computed per "
        "micro-batch, so the loss and gradients differ from eager on the whole batch. Compile "
        "with micro_batch_size equal to the batch for eager's numbers, or compute it per "
        "sample", MicroBatchStateWarning, stacklevel=stacklevel)


def refuse_layout_dependent_draws(gm: fx.GraphModule, what: str, num_micro_batches: int,
                                  data_parallel: int) -> None:
    """A random draw whose batch is not its dim 0 (``annotate_shapes``: ``random_layout``)
    cannot be keyed per sample, and shared it draws other numbers for each micro-batch size
    and replica's batch: refused when the plan splits the batch."""
    if num_micro_batches <= 1 and data_parallel <= 1:
        return
    node = next((n for n in gm.graph.nodes if info(n).random_layout), None)
    if node is None:
        return
    where = f" at {info(node).source}" if info(node).source else ""
    raise InputError(
        f"{what} draws random numbers of shape {info(node).random_layout} (b: the batch)"
        f"{where}, not one independent row per sample on dim 0 (torch.randn(d, b), "
        "torch.rand(h.numel()), torch.randperm(b) are such draws), and the plan "
        f"splits each batch ({num_micro_batches} micro-batches x {data_parallel} "
        f"replica{'' if data_parallel == 1 else 's'}): a "
        "pipeline keys random numbers per sample on dim 0 so that no micro-batch size, stage "
        "count or replica count changes them, which this draw's layout does not allow. Draw "
        "with the batch first (torch.randn(b, d).T instead of torch.randn(d, b), "
        "torch.rand_like(h) instead of torch.rand(h.numel()).view_as(h)), or compile with "
        "micro_batch_size equal to the batch on one replica")


def graph_findings(gm: fx.GraphModule) -> list[Finding]:
    """What ``mark_sample_mixing`` found, in graph order."""
    return [Finding(n.name, info(n).mixes_samples, info(n).source) for n in gm.graph.nodes
            if info(n).mixes_samples]
