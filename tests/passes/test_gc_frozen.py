"""The passes run with older objects frozen (passes/manager.py: old_objects_frozen): the
collector is as it was afterwards, and a freeze the user made is left alone; the lazily compiled
copy of a graph gives the graph's code when asked."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
import torch.fx as fx
from torch import nn

from varuna_fx.ir.nodes import copy_graph_module
from varuna_fx.passes.manager import GraphState, Pass, run_passes


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    """The suite freezes what it collected (tests/conftest.py): thawed for these tests, frozen
    again after."""
    frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    yield
    if frozen:
        gc.freeze()


def _seen(counts: list[int]) -> Pass:
    return Pass("probe", "records the freeze count", lambda s: counts.append(
        gc.get_freeze_count()), graph=False)


def test_objects_are_frozen_while_passes_run_and_handed_back_after() -> None:
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    counts: list[int] = []
    run_passes([_seen(counts)], GraphState())
    assert counts[0] > 0  # older objects frozen while the pass ran
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_a_freeze_made_before_is_left_as_it_was() -> None:
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        counts: list[int] = []
        run_passes([_seen(counts)], GraphState())
        assert gc.get_freeze_count() == before
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        counts = []
        run_passes([_seen(counts)], GraphState())
        assert counts == [0] and not gc.isenabled()
    finally:
        gc.enable()


def test_the_lazy_copy_has_the_code_of_the_graph_and_runs_it() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    gm = fx.symbolic_trace(model)
    copy = copy_graph_module(gm)
    assert copy.code == gm.code
    x = torch.randn(5, 3)
    torch.testing.assert_close(copy(x), model(x), rtol=0, atol=0)
