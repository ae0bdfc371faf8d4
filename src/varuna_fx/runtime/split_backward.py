"""Split backward: input gradients now (``B``), weight gradients later (``W``).

The input-gradient pass back-propagates from the stage's outputs only to its received values
(what the upstream stage waits for) with ``torch.autograd.grad(..., retain_graph=True)``, and on
the way keeps the gradients arriving at the autograd nodes where parameters join that path
(pre-hooks). The weight pass later continues from exactly those saved gradients to the
parameters and accumulates into ``.grad`` as eager ``backward()`` does (summed into what is
there: gradient accumulation and tied parameters used by several stages add up). So no part of
the backward runs twice. The graph analysis and the two passes are torch's own
(``torch.distributed.pipelining._backward``, the zero-bubble schedules' implementation).

Where a parameter's gradient does not flow through the received values (stage 0, whose inputs
need no gradient, or a parameter only reached from the model's inputs), the split is not
possible: the whole backward then runs in the weight pass (stage 0: nobody waits for its input
gradients) or, when input gradients are needed too, entirely in the input pass (``W`` then has
nothing left to do). Both are exact; only the overlap is lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

try:  # private torch API: fall back to an unsplit backward where it is missing
    from torch.distributed.pipelining._backward import (
        _get_grad_fn_or_grad_acc,
        construct_reverse_graph,
        get_param_groups,
        stage_backward_weight,
    )
except ImportError:  # pragma: no cover - depends on the torch build
    construct_reverse_graph = None  # type: ignore[assignment]


@dataclass
class Deferred:
    """What the weight pass of one micro-batch needs."""

    params: list[nn.Parameter]
    groups: list[dict[str, Any]] | None = None  # saved intermediate gradients (split)
    tensors: list[torch.Tensor] = field(default_factory=list)  # whole backward (no leaves)
    seeds: list[torch.Tensor] = field(default_factory=list)

    def run(self) -> None:
        if self.groups is not None:
            # groups share parts of the graph (a layer used twice): keep it until all ran; it
            # is freed when this object lets go of it
            stage_backward_weight(iter(self.params), self.groups, retain_graph=True)
        elif self.tensors:  # only into the parameters: input gradients are done (or unneeded)
            torch.autograd.backward(self.tensors, self.seeds, inputs=self.params or None)
        self.groups, self.tensors, self.seeds = None, [], []


def _node(t: torch.Tensor) -> Any:
    return _get_grad_fn_or_grad_acc(t)


def input_grads(tensors: list[torch.Tensor], seeds: list[torch.Tensor],
                leaves: list[torch.Tensor], params: list[nn.Parameter]) -> Deferred:
    """Back-propagate ``seeds`` from ``tensors`` into ``leaves`` (their ``.grad``), deferring
    the parameters' gradients to the returned :class:`Deferred` where that is possible."""
    params = [p for p in params if p.requires_grad]
    wanted = [x for x in leaves if x.requires_grad]
    if not tensors:
        return Deferred(params)
    if not wanted:  # no input gradient needed: everything can wait for the weight pass
        return Deferred(params, tensors=tensors, seeds=seeds)
    groups = _param_groups(tensors, wanted, params) if construct_reverse_graph else None
    if groups is None:  # cannot split exactly: the whole backward now
        torch.autograd.backward(tensors, seeds)
        return Deferred(params)
    handles = []
    for group in groups:
        group["intermediates"] = list(group["intermediates"])
        for k, node in enumerate(group["intermediates"]):
            handles.append(node.register_prehook(_saver(group, k)))
    try:
        grads = torch.autograd.grad(tensors, wanted, seeds, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for leaf, g in zip(wanted, grads):
        if g is not None:
            leaf.grad = g if leaf.grad is None else leaf.grad + g
    if any(g.get("grads") is None for g in groups):
        # a join the input pass did not cross: the weight pass walks the graph again instead
        return Deferred(params, tensors=tensors, seeds=seeds)
    # (torch's version detaches the outputs in place here to free the graph early; an output
    # that a later operation of the stage also saved would then break the weight pass)
    return Deferred(params, groups=groups)


def _saver(group: dict[str, Any], k: int) -> Any:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        if group.get("grads") is None:
            group["grads"] = [None] * len(group["intermediates"])
        group["grads"][k] = grad_outputs
    return hook


def _param_groups(tensors: list[torch.Tensor], leaves: list[torch.Tensor],
                  params: list[nn.Parameter]) -> list[dict[str, Any]] | None:
    """torch's parameter groups, or None unless every parameter the backward reaches gets its
    gradient through them (else the split would silently drop gradients)."""
    roots = [n for n in map(_node, tensors) if n is not None]
    reverse = construct_reverse_graph(roots)
    reached = [n for n in map(_node, params) if n in reverse or n in roots]
    if not reached:
        return None
    groups = get_param_groups([_node(x) for x in leaves], reached, reverse)
    covered = set().union(*(g["params"] for g in groups)) if groups else set()
    if covered != set(reached):
        return None
    return groups
