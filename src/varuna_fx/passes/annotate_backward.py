"""annotate_backward: forward/backward FLOPs and the parameters each node reads.

Backward FLOPs follow the usual estimate: a matmul-class op costs twice its forward (one
product for the input gradient, one for the weight gradient); an elementwise op costs about
its forward. Ops producing no floating-point value have no backward. Measured profiles (the
planner's) replace these estimates when they exist.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from ..ir.nodes import info


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every parameter/buffer FQN -> the first FQN of the same tensor (``nn.Module``'s order).

    Tied weights (GPT-2's embedding and LM head) are one tensor under two names; everything
    downstream works with the canonical (first) name.
    """
    first: dict[int, str] = {}
    names: dict[str, str] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]:
        names[name] = first.setdefault(id(tensor), name)
    return names


def annotate_backward(gm: fx.GraphModule, canonical: dict[str, str]) -> None:
    for node in gm.graph.nodes:
        meta = info(node)
        meta.params = _params_read(gm, node, canonical)
        meta.fwd_flops = meta.matmul_flops + meta.elementwise_flops
        differentiable = any(t.dtype.is_floating_point for t in meta.outputs)
        meta.bwd_flops = (
            meta.matmul_flops.scale(2.0) + meta.elementwise_flops if differentiable else
            meta.matmul_flops.scale(0.0)
        )


def _params_read(gm: fx.GraphModule, node: fx.Node,
                 canonical: dict[str, str]) -> dict[str, int]:
    tensors: dict[str, torch.Tensor] = {}
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        prefix = f"{node.target}."
        for name, t in [*module.named_parameters(remove_duplicate=False),
                        *module.named_buffers(remove_duplicate=False)]:
            tensors[canonical.get(prefix + name, prefix + name)] = t
    elif node.op == "get_attr":
        value = _get_attr(gm, str(node.target))
        # A tensor the tracer lifted out of forward (``torch.tensor(0)`` in T5's
        # ``_shift_right``) is a constant of the graph, not model state: each stage module
        # reading it keeps its own reference, so no stage needs to own it.
        if isinstance(value, torch.Tensor) and str(node.target) in canonical:
            tensors[canonical[str(node.target)]] = value
    return {name: t.numel() * t.element_size() for name, t in tensors.items()}


def _get_attr(root: nn.Module, target: str) -> object:
    obj: object = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
