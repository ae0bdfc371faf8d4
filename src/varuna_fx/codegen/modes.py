"""Train and eval mode: a graph captured in one mode may not be the model in the other.

fx bakes ``if self.training:`` and ``F.dropout(x, p, self.training)`` into the graph, and
torch.export bakes even ``nn.Dropout``; only module calls kept by fx (``nn.Dropout``,
``nn.BatchNorm``) follow ``.train()``/``.eval()`` at run time. So when the modules' modes
differ from those at compile, the model is captured again in its current modes: if that graph
is the compiled one, the compiled stages serve; otherwise evaluation runs the new graph, cut
where the compiled stages hold the parameters it reads (so a distributed rank has them), and
training refuses with a clear error (a plan is made for one training graph).

Distributed ranks capture eval mode at compile, with zero-filled example inputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.fx as fx
from torch import nn

from ..capture.captured import Captured
from ..capture.inputs import BoundInputs
from ..capture.trace import capture
from ..errors import VarunaFxError
from ..ir.nodes import info
from ..passes.annotate_backward import annotate_backward
from ..passes.annotate_shapes import annotate_shapes
from ..passes.mark_replicable import mark_replicable
from ..passes.specialize_sizes import specialize_sizes
from ..passes.split_stages import split_stages
from .stage_module import Stage, build_stage

Modes = tuple[bool, ...]


def module_modes(model: nn.Module) -> Modes:
    return tuple(m.training for m in model.modules())


@contextlib.contextmanager
def modes_set(model: nn.Module, training: bool) -> Iterator[None]:
    """Every module in ``training`` mode for the body, then each back to its own mode."""
    before = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, mode in before:
            m.training = mode


def capture_if_changed(model: nn.Module, compiled: Captured,
                       bound: BoundInputs) -> Captured | None:
    """The model captured in its current modes, or None when that is the compiled graph."""
    fresh = capture(model, bound, compiled.tracer)
    return None if fresh.gm.code == compiled.gm.code else fresh


def evaluation_stages(model: nn.Module, fresh: Captured, bound: BoundInputs,
                      compiled: list[Stage], canonical: dict[str, str],
                      num_stages: int) -> tuple[Captured, list[Stage]]:
    """Stages for ``fresh`` (the model in its current modes): ``num_stages`` of them, each node
    on the first stage at or after its inputs' that holds every parameter and buffer it reads."""
    gm = fresh.gm
    annotate_shapes(gm, bound)
    specialize_sizes(gm)
    annotate_backward(gm, canonical)
    mark_replicable(gm)
    holders: dict[str, set[int]] = {}
    for s in compiled:
        for name in [*s.parameter_names, *s.spec.buffer_names]:
            holders.setdefault(name, set()).add(s.index)
    needs: dict[fx.Node, set[str]] = {}
    stage_of: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        needs[node] = set(info(node).params)
        for i in node.all_input_nodes:
            if info(i).replicable:
                needs[node] |= needs[i]
        if node.op in ("placeholder", "get_attr", "output") or info(node).replicable:
            continue
        lowest = max((stage_of.get(i, 0) for i in node.all_input_nodes), default=0)
        allowed = set(range(lowest, num_stages))
        for name in needs[node]:
            allowed &= holders.get(name, set(range(num_stages)))
        if not allowed:
            raise VarunaFxError(
                f"in {'training' if model.training else 'eval'} mode {type(model).__name__} "
                f"computes '{node.name}' after reading {sorted(needs[node])}, which stages "
                "before it hold: this pipeline cannot run that mode. Compile the model in "
                "this mode (vf.compile after model.eval()) for evaluation"
            )
        info(node).stage = stage_of[node] = min(allowed)
    trainable = {canonical[n] for n, p in model.named_parameters(remove_duplicate=False)
                 if p.requires_grad}
    order = list(dict.fromkeys(canonical.values()))
    params = {canonical[n] for n, _ in model.named_parameters(remove_duplicate=False)}
    graphs = split_stages(gm, num_stages, trainable)
    name = type(model).__name__
    return fresh, [build_stage(gm, g, num_stages, order, name, params) for g in graphs]
