"""The passes run with Python's cyclic collector paused (passes/manager.py: collector_paused):
it is on again afterwards, and left off where it was off; the lazily compiled copy of a graph
gives the graph's code when asked."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.fx as fx
from torch import nn

from varuna_fx.ir.nodes import copy_graph_module
from varuna_fx.passes.manager import GraphState, Pass, run_passes


def _seen(states: list[bool]) -> Pass:
    return Pass("probe", "records whether the collector runs", lambda s: states.append(
        gc.isenabled()), graph=False)


def test_the_collector_is_paused_while_passes_run_and_on_again_after() -> None:
    assert gc.isenabled()
    states: list[bool] = []
    run_passes([_seen(states)], GraphState())
    assert states == [False] and gc.isenabled()


def test_it_is_on_again_after_a_pass_raises() -> None:
    def fail(state: GraphState) -> None:
        raise RuntimeError("a pass failed")

    with pytest.raises(RuntimeError):
        run_passes([Pass("fails", "raises", fail, graph=False)], GraphState())
    assert gc.isenabled()


def test_a_collector_turned_off_before_stays_off() -> None:
    gc.disable()
    try:
        states: list[bool] = []
        run_passes([_seen(states)], GraphState())
        assert states == [False] and not gc.isenabled()
    finally:
        gc.enable()


def test_the_lazy_copy_has_the_code_of_the_graph_and_runs_it() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    gm = fx.symbolic_trace(model)
    copy = copy_graph_module(gm)
    assert copy.code == gm.code
    x = torch.randn(5, 3)
    torch.testing.assert_close(copy(x), model(x), rtol=0, atol=0)
