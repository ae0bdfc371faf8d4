"""Train and eval mode: a graph captured in one mode may not be the model in the other.

fx bakes ``if self.training:`` and ``F.dropout(x, p, self.training)`` into the graph, and
torch.export bakes even ``nn.Dropout``; only module calls kept by fx (``nn.Dropout``,
``nn.BatchNorm``) follow ``.train()``/``.eval()`` at run time. So when the modules' modes
differ from those at compile, the model is captured again in its current modes: if that graph
is the compiled one, the compiled stages serve; otherwise evaluation runs the new graph and
training refuses with a clear error (a plan is made for one training graph).

The new graph is compiled by the pass list (``pass_list.PASS_LIST``: its checkers, its dumps,
under ``<dump>/eval``, and its sample-mixing pass) with one substitution: there is no
configure, and instead of the partition each node goes on the first stage at or after its
inputs' that holds every parameter and buffer it reads (so a distributed rank has them).

Distributed ranks capture eval mode at compile, with zero-filled example inputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch.fx as fx
from torch import nn

from ..capture.captured import Captured
from ..capture.inputs import BoundInputs
from ..errors import VarunaFxError
from ..ir.nodes import info
from ..passes.check import check_assignment
from ..passes.manager import Pass, run_passes, substitute, write_dump
from .pass_list import PASS_LIST, CompileState
from .stage_module import Stage

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


def evaluation_stages(model: nn.Module, bound: BoundInputs, compiled: Captured,
                      stages: list[Stage], canonical: dict[str, str], num_stages: int,
                      dump: Path | None = None) -> tuple[Captured, list[Stage]] | None:
    """The model in its current modes compiled into ``num_stages`` stages, each node on the
    first stage at or after its inputs' that holds (in ``stages``, the compiled ones) every
    parameter and buffer it reads; None when it captures the ``compiled`` graph."""
    holders: dict[str, set[int]] = {}
    for s in stages:
        for name in [*s.parameter_names, *s.spec.buffer_names]:
            holders.setdefault(name, set()).add(s.index)
    by_holders: Pass[CompileState] = Pass(
        "assign_by_holders", "every compute node has a stage: the first at or after its "
        "inputs' that holds every parameter and buffer it reads (no edge goes backwards)",
        lambda state: assign_by_holders(state, holders),
        lambda state: check_assignment(state.gm, state.num_stages))
    passes = substitute(PASS_LIST, configure=None, assign_stages=by_holders)
    state = CompileState(model=model, bound=bound, tracer=compiled.tracer, canonical=canonical,
                         num_stages=num_stages, pass_list=passes)
    run_passes(passes[:1], state)  # capture: is it the compiled graph?
    assert state.captured is not None and state.built is None
    if state.captured.gm.code == compiled.gm.code:
        return None
    where = None if dump is None else dump / _modes_name(model)
    if where is not None:
        write_dump(where, passes[:1], state)
    run_passes(passes[1:], state, dump=where, done=passes[:1])
    assert state.built is not None
    return state.captured, state.built


def assign_by_holders(state: CompileState, holders: dict[str, set[int]]) -> None:
    """Each compute node on the first stage at or after its inputs' whose compiled stage
    holds every parameter and buffer it reads (``holders``: name -> those stages)."""
    model, num_stages = state.model, state.num_stages
    assert state.gm is not None
    needs: dict[fx.Node, set[str]] = {}
    stage_of: dict[fx.Node, int] = {}
    for node in state.gm.graph.nodes:
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


def _modes_name(model: nn.Module) -> str:
    """The dump folder of a recompile: "eval", "train", or "mixed" modes."""
    modes = set(module_modes(model))
    return "mixed" if len(modes) > 1 else "train" if True in modes else "eval"
