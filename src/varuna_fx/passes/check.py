"""Invariant checks run between passes (always on in tests; cheap enough to leave on).

A failure here is a bug in varuna_fx, not in the user's model, so it raises AssertionError
with the offending node rather than a VarunaFxError.
"""

from __future__ import annotations

import torch.fx as fx

from ..ir.nodes import info
from .split_stages import StageGraph


class InvariantError(AssertionError):
    pass


def check_assignment(gm: fx.GraphModule, num_stages: int) -> None:
    """Every compute node has a stage, and no edge goes from a later stage to an earlier one."""
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output") or info(node).replicable:
            continue
        stage = info(node).stage
        if stage is None or not 0 <= stage < num_stages:
            raise InvariantError(f"node {node.name} has no valid stage ({stage})")
        for inp in node.all_input_nodes:
            src = info(inp).stage
            if not info(inp).replicable and src is not None and src > stage:
                raise InvariantError(
                    f"edge {inp.name} (stage {src}) -> {node.name} (stage {stage}) goes backwards"
                )


def check_split(gm: fx.GraphModule, stages: list[StageGraph]) -> None:
    """Boundaries match: each receive has its send on an earlier stage, and every value a stage
    reads is an input, a receive or computed in the stage itself."""
    sends = {(t.name, t.src, t.dst) for s in stages for t in s.spec.sends}
    inputs = {str(n.target) for n in gm.graph.nodes if n.op == "placeholder"}
    for s in stages:
        for t in s.spec.recvs:
            if t.src >= t.dst or (t.name, t.src, t.dst) not in sends:
                raise InvariantError(f"stage {s.spec.index} receives {t.name} nobody sends")
        sources = [*s.spec.inputs, *dict.fromkeys(t.name for t in s.spec.recvs)]
        placeholders = [n for n in s.graph.nodes if n.op == "placeholder"]
        if len(sources) != len(placeholders) or not set(s.spec.inputs) <= inputs:
            raise InvariantError(f"stage {s.spec.index}: placeholders {placeholders} do not "
                                 f"match its inputs and receives {sources}")
        produced = {n.name for n in s.graph.nodes}
        for t in s.spec.sends:
            if t.name not in produced:
                raise InvariantError(f"stage {s.spec.index} sends {t.name} it does not compute")
    computed = [n.name for s in stages for n in s.graph.nodes
                if n.op not in ("placeholder", "get_attr", "output") and not info(n).replicable]
    if len(computed) != len(set(computed)):
        raise InvariantError("a compute node appears in two stages")


def check_parameters(gm: fx.GraphModule, held: list[list[str]], canonical: dict[str, str]) -> None:
    """Every parameter the graph reads is held by at least one stage."""
    read = {name for n in gm.graph.nodes for name in info(n).params}
    owned = {name for names in held for name in names}
    missing = read - owned
    if missing:
        raise InvariantError(f"parameters read but owned by no stage: {sorted(missing)[:5]}")


def check_graph(gm: fx.GraphModule) -> None:
    """After every pass: the graph is well formed (fx's lint: defined before use, one output)
    and every annotated node's NodeInfo is its own (node copies copy their annotations)."""
    gm.graph.lint()
    seen: dict[int, str] = {}
    for node in gm.graph.nodes:
        meta = node.meta.get("varuna")
        if meta is None:
            continue
        if id(meta) in seen:
            raise InvariantError(f"nodes {seen[id(meta)]} and {node.name} share one NodeInfo")
        seen[id(meta)] = node.name
