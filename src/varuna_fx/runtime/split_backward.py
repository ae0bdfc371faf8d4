"""Split backward: input gradients now (``B``), weight gradients later (``W``).

The autograd graph of one micro-batch splits in two. The *input region* is every node from
which a received value (what the upstream stage waits for) can be reached: the input pass
``torch.autograd.grad(..., retain_graph=True)`` runs exactly those nodes. A path from an output
to a parameter starts inside that region or outside it, and once it leaves the region it never
comes back (a node outside reaches no received value, so neither do the nodes after it). So
every parameter gradient is the sum of what flows out of the region's *boundary nodes* (region
nodes with an edge leaving it towards a parameter) and what starts at outputs outside the region.
The input pass keeps the gradients arriving at the boundary nodes (pre-hooks); the weight pass
starts again from exactly those, plus the outputs outside the region with their own seeds, and
accumulates into ``.grad`` with ``torch.autograd.backward(inputs=...)``, as eager ``backward()``
does (summed into what is there: gradient accumulation and tied parameters add up).

Parameters are grouped so that each weight-pass call only runs the nodes leading to its own
parameters: two parameters share a group when their paths to the region share a node (a tied
weight used by several layers, a weight and its bias). One group per connected component, so no
parameter is ever in two groups (``torch.distributed.pipelining``'s ``get_param_groups`` can put
a tied weight into two and count its gradient twice, and drops outputs outside the region). A
boundary node that is also reached from another boundary node of its group gets its saved
gradient back in the weight pass (a pre-hook replaces what arrives), so nothing counts twice.

Stage 0 needs no input gradients: its whole backward runs in the weight pass. If a boundary node
did not run in the input pass (no gradient arrived), the weight pass redoes the whole backward
into the parameters only: exact, only the saved work is lost.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class _Group:
    """Parameters whose gradients the weight pass computes in one call."""

    params: list[nn.Parameter]
    boundary: list[Node]  # input-region nodes with an edge out of it towards these params
    roots: list[int]  # indices of the outputs outside the input region that reach them
    outputs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # and seeds
    saved: list[tuple[torch.Tensor | None, ...] | None] = field(default_factory=list)


@dataclass
class Deferred:
    """What the weight pass of one micro-batch needs."""

    params: list[nn.Parameter]
    groups: list[_Group] | None = None  # split: saved boundary gradients per group
    tensors: list[torch.Tensor] = field(default_factory=list)
    seeds: list[torch.Tensor] = field(default_factory=list)

    def run(self) -> None:
        if self.groups is not None:
            for group in self.groups:
                _weight_pass(group)
        elif self.tensors:  # only into the parameters: input gradients are done (or unneeded)
            torch.autograd.backward(self.tensors, self.seeds, inputs=self.params or None)
        # letting go of the groups and outputs frees the retained graph
        self.groups, self.tensors, self.seeds = None, [], []


def _node(t: torch.Tensor) -> Node | None:
    """The node a gradient of ``t`` enters: its ``grad_fn``, or a leaf's accumulator."""
    return get_gradient_edge(t).node if t.requires_grad else None


def input_grads(tensors: list[torch.Tensor], seeds: list[torch.Tensor],
                leaves: list[torch.Tensor], params: list[nn.Parameter]) -> Deferred:
    """Back-propagate ``seeds`` from ``tensors`` into ``leaves`` (their ``.grad``), deferring
    the parameters' gradients to the returned :class:`Deferred`."""
    params = [p for p in params if p.requires_grad]
    wanted = [x for x in leaves if x.requires_grad]
    if not tensors:
        return Deferred(params)
    if not wanted:  # no input gradient needed: everything can wait for the weight pass
        return Deferred(params, tensors=tensors, seeds=seeds)
    groups = _param_groups(tensors, wanted, params)
    handles = []
    for group in groups:
        group.saved = [None] * len(group.boundary)
        for k, node in enumerate(group.boundary):
            handles.append(node.register_prehook(_saver(group, k)))
    try:
        grads = torch.autograd.grad(tensors, wanted, seeds, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for leaf, g in zip(wanted, grads):
        if g is not None:
            leaf.grad = g if leaf.grad is None else leaf.grad + g
    if any(s is None for group in groups for s in group.saved):
        # a boundary node the input pass did not run: walk the whole graph again instead
        return Deferred(params, tensors=tensors, seeds=seeds)
    for group in groups:  # keep only the outputs the weight pass starts from
        group.outputs = [(tensors[i], seeds[i]) for i in group.roots]
    return Deferred(params, groups=groups)


def _saver(group: _Group, k: int) -> Any:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        group.saved[k] = grad_outputs
    return hook


def _clamp(saved: tuple[torch.Tensor | None, ...]) -> Any:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        return saved  # what the input pass saw here, not that plus a re-run's share
    return hook


def _weight_pass(group: _Group) -> None:
    starts: list[torch.Tensor | GradientEdge] = []
    grads: list[torch.Tensor] = []
    for node, saved in zip(group.boundary, group.saved):
        assert saved is not None
        for i, g in enumerate(saved):
            if g is not None:
                starts.append(GradientEdge(node, i))
                grads.append(g)
    for t, seed in group.outputs:
        starts.append(t)
        grads.append(seed)
    if not starts:
        return
    handles = [node.register_prehook(_clamp(saved))
               for node, saved in zip(group.boundary, group.saved)]
    try:
        # the groups may re-run shared region nodes: keep the graph until all of them ran
        torch.autograd.backward(starts, grads, retain_graph=True, inputs=group.params)
    finally:
        for h in handles:
            h.remove()


def _param_groups(tensors: list[torch.Tensor], wanted: list[torch.Tensor],
                  params: list[nn.Parameter]) -> list[_Group]:
    """The weight pass's groups: one per connected component of the parameters' paths up to
    the input region (see the module docstring)."""
    roots: dict[Node, list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        node = _node(t)
        if node is not None:
            roots[node].append(i)
    # consumers[n]: the nodes whose backward sends gradient into n (the forward's users)
    consumers: dict[Node, list[Node]] = defaultdict(list)
    seen = set(roots)
    stack = list(roots)
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            consumers[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    # the input region: nodes from which a wanted leaf is reached (what the input pass runs)
    region: set[Node] = set()
    stack = [n for n in map(_node, wanted) if n is not None and n in seen]
    region.update(stack)
    while stack:
        for user in consumers[stack.pop()]:
            if user not in region:
                region.add(user)
                stack.append(user)
    # walk from each parameter towards the outputs, stopping at the region; union-find joins
    # every node a walk touches, so parameters sharing any node share a group
    parent: dict[Node, Node] = {}

    def find(n: Node) -> Node:
        parent.setdefault(n, n)
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    by_node: dict[Node, nn.Parameter] = {}
    boundary: set[Node] = set()
    walked: set[Node] = set()
    for p in params:
        node = _node(p)
        if node is None or node not in seen or node in by_node:
            continue
        by_node[node] = p
        find(node)
        walked.add(node)
        stack = [node]
        while stack:
            n = stack.pop()
            for user in consumers[n]:
                parent[find(user)] = find(n)
                if user in region:
                    boundary.add(user)
                elif user not in walked:
                    walked.add(user)
                    stack.append(user)
    groups: dict[Node, _Group] = {}
    for node, p in by_node.items():
        groups.setdefault(find(node), _Group([], [], [])).params.append(p)
    for node in boundary:
        groups[find(node)].boundary.append(node)
    for node, indices in roots.items():
        if node in walked and node not in region:
            groups[find(node)].roots.extend(indices)
    return list(groups.values())
