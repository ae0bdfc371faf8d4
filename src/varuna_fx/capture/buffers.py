"""Module state (buffers) that compile-time work must leave exactly as it found it.

Compiling runs the model's graph without the user asking for a forward: twice on fake tensors
(``annotate_shapes``) and, with ``profile=True``, for real to time it. An in-place buffer
update in the graph (BatchNorm's running statistics and ``num_batches_tracked``, a user's
``self.calls.add_(1)``) would then count runs eager PyTorch never did.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.fx as fx
from torch import nn

from ..ir.nodes import info
from .mutations import aliases_first_input, hop_written_inputs, written_arguments


@contextlib.contextmanager
def buffers_kept(module: nn.Module) -> Iterator[None]:
    """Run the body, then put every buffer of ``module`` back to its value before it."""
    saved = []
    with torch.no_grad():
        for buffer in {id(b): b for b in module.buffers()}.values():
            saved.append((buffer, buffer.clone()))
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:  # all: BatchNorm's kernel writes without a version bump
                buffer.copy_(value)


class MicroBatchStateWarning(UserWarning):
    """Module state updated per micro-batch (BatchNorm statistics, in-place buffer writes) or
    a loss over the whole batch's statistics (a router load-balancing loss) cannot follow
    eager on the whole batch."""


def written_buffers(node: fx.Node) -> list[str]:
    """The attribute paths of the buffers an in-place node writes (``self.calls.add_(1)``, or
    ``add_`` in ``self.ema.mul_(0.9).add_(v)``, or a torch.no_grad() block's writes)."""
    return _written_attributes(node, "_buffers")


def written_parameters(node: fx.Node) -> list[str]:
    """The attribute paths of the parameters an in-place node writes (``w.clamp_(...)`` in a
    torch.no_grad() block, ``w.data.mul_(0.9)``)."""
    return _written_attributes(node, "_parameters")


def _written_attributes(node: fx.Node, kind: str) -> list[str]:
    if not info(node).mutates:
        return []
    bases = [node.args[0]] if node.args else []
    root = node.graph.owning_module
    if isinstance(node.target, torch._ops.HigherOrderOperator):  # a write inside a subgraph
        bases = list(hop_written_inputs(node, root)) if root is not None else []
    elif isinstance(node.target, torch._ops.OpOverload):  # `out=` ops write their out
        bases = written_arguments(node)
    found = []
    for base in bases:
        while isinstance(base, fx.Node) and aliases_first_input(base):
            base = base.args[0]  # views and earlier writes of the same tensor
        if isinstance(base, fx.Node) and base.op == "get_attr" and root is not None \
                and _is_attribute(root, str(base.target), kind):
            found.append(str(base.target))
    return found


def _is_attribute(root: nn.Module, target: str, kind: str) -> bool:
    """Whether ``target`` names one of ``root``'s buffers (``kind="_buffers"``) or
    parameters (``"_parameters"``)."""
    owner, _, name = target.rpartition(".")
    try:
        module = root.get_submodule(owner) if owner else root
    except AttributeError:
        return False
    return name in getattr(module, kind)


def mutated_buffers(gm: fx.GraphModule) -> list[str]:
    """Buffers the graph writes in place (``self.calls.add_(1)``), by the attribute path."""
    return list(dict.fromkeys(b for node in gm.graph.nodes for b in written_buffers(node)))


# Hugging Face's auxiliary loss of mixture-of-experts models (Mixtral, Qwen2-MoE, OLMoE...):
# the fraction of tokens routed to each expert times their mean router probability, over the
# whole batch: not a mean of per-sample terms. Found by name in the nodes' source lines.
_ROUTER_BALANCE = "load_balancing_loss_func"


def warn_micro_batch_state(model: nn.Module, gm: fx.GraphModule,
                           num_micro_batches: int) -> None:
    """Warn (at compile) when state updated per forward meets more than one micro-batch."""
    if num_micro_batches <= 1:
        return
    norms = [name for name, m in model.named_modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    if norms:
        warnings.warn(
            f"{type(model).__name__} has BatchNorm ({', '.join(norms[:3])}"
            f"{', ...' if len(norms) > 3 else ''}) and the plan splits each batch into "
            f"{num_micro_batches} micro-batches: BatchNorm normalises and updates its running "
            "statistics per micro-batch, so training differs from eager on the whole batch. "
            "Compile with micro_batch_size equal to the batch for eager's numbers, or use "
            "GroupNorm/LayerNorm", MicroBatchStateWarning, stacklevel=3)
    balancing = next((n for n in gm.graph.nodes
                      if _ROUTER_BALANCE in (n.meta.get("stack_trace") or "")), None)
    if balancing is not None:
        warnings.warn(
            f"{type(model).__name__} adds a router load-balancing loss ({_ROUTER_BALANCE}, a "
            "mixture of experts with output_router_logits=True) and the plan splits each batch "
            f"into {num_micro_batches} micro-batches: that loss is a statistic over all tokens "
            "routed together, here each micro-batch's, so the loss and gradients differ from "
            "eager on the whole batch. Compile with micro_batch_size equal to the batch for "
            "eager's numbers", MicroBatchStateWarning, stacklevel=3)
    written = [b for b in mutated_buffers(gm)  # torch.export: BatchNorm's own counter
               if b.rpartition(".")[0] not in norms]
    if written:
        warnings.warn(
            f"{type(model).__name__} writes buffers in place ({', '.join(written[:3])}) and the "
            f"plan splits each batch into {num_micro_batches} micro-batches: they are written "
            "once per micro-batch, where eager writes once per batch. Compile with "
            "micro_batch_size equal to the batch for eager's numbers",
            MicroBatchStateWarning, stacklevel=3)
