"""The plan knows how sure it is, and learns (issue 41, item 5): the predicted step with the
profile's spread, a warning once when the first steps differ from it by more than 20% naming
the cost term that was off (planner/drift.py), and ``plan.explain()``."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

import varuna_fx as vf
from varuna_fx.planner.drift import DriftCheck, drift_message
from varuna_fx.planner.plan import Alternative, Plan, explain_pick


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.layers(x), y)


@pytest.fixture(scope="module")
def pipe() -> vf.Pipeline:
    torch.manual_seed(0)
    return vf.compile(Regression(), example_inputs=(torch.randn(8, 16), torch.randn(8, 16)),
                      micro_batch_size=4)


def _plan(plan: Plan, **changes: object) -> Plan:
    """A two-stage plan predicting 100 ms: 60 ms compute per stage, 10 ms all-reduce."""
    base = dict(predicted_step_time=0.1, priced_here=True, num_micro_batches=2,
                stage_busy=(0.03, 0.03), cost_terms=(("compute", 0.06), ("all-reduce", 0.01),
                                                     ("bubble", 0.03)))
    return dataclasses.replace(plan, **{**base, **changes})  # type: ignore[arg-type]


def test_within_the_tolerance_nothing_is_said(pipe: vf.Pipeline) -> None:
    assert drift_message(_plan(pipe.plan), 0.115) is None
    assert drift_message(_plan(pipe.plan), 0.085) is None


def test_the_term_that_was_off_is_named(pipe: vf.Pipeline) -> None:
    # stage 0 computed as predicted (2 x 30 ms) but waited 100 ms more: messages/bubble
    waited = [(0, "F", 0, 0.0, 0.015), (0, "B", 0, 0.015, 0.03), (0, "F", 1, 0.03, 0.045),
              (0, "B", 1, 0.045, 0.06), (0, "wait", 1, 0.06, 0.19), (-1, "sync", -1, 0.19, 0.2)]
    said = drift_message(_plan(pipe.plan), 0.2, waited)
    assert said is not None and "+100%" in said and "messages and bubble" in said
    # the same step, its compute three times the prediction
    slow = [(0, "F", 0, 0.0, 0.09), (0, "B", 0, 0.09, 0.18), (-1, "sync", -1, 0.18, 0.2)]
    said = drift_message(_plan(pipe.plan), 0.2, slow)
    assert said is not None and "compute" in said and "measured 180.0 ms" in said
    # no timeline: the largest predicted term
    said = drift_message(_plan(pipe.plan), 0.3)
    assert said is not None and "compute (the largest predicted" in said


def test_it_warns_once_after_the_warm_up(pipe: vf.Pipeline) -> None:
    check = DriftCheck(_plan(pipe.plan))
    said = [check.observe(s) for s in (5.0, 0.3, 0.3, 0.3, 0.3, 0.3)]
    assert said[:3] == [None, None, None] and said[3] is not None and said[4:] == [None, None]
    # a plan not priced with this machine's costs (a hypothetical cluster) is never held to it
    quiet = DriftCheck(_plan(pipe.plan, priced_here=False))
    assert all(quiet.observe(1.0) is None for _ in range(5))
    assert all(DriftCheck(_plan(pipe.plan), False).observe(1.0) is None for _ in range(5))


def test_the_pipeline_warns_once(pipe: vf.Pipeline) -> None:
    """A fake prediction (1 us): the fourth step warns, once, naming a term."""
    assert pipe.plan.priced_here  # compile's defaults price this machine (planner/machine.py)
    pipe.plan = dataclasses.replace(pipe.plan, predicted_step_time=1e-6)
    pipe._drift = None
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            pipe.step(x, y)
    said = [str(w.message) for w in caught if "predicted" in str(w.message)]
    assert len(said) == 1 and "term furthest off" in said[0]


def test_only_rank_0_warns(pipe: vf.Pipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank runs the same step against the same plan: the job's one warning is rank 0's
    (a rank 1 is this one-process pipeline told it is rank 1; nothing launched)."""
    monkeypatch.setattr(pipe, "plan", dataclasses.replace(pipe.plan, predicted_step_time=1e-6))
    monkeypatch.setattr(pipe.runtime, "rank", 1)
    monkeypatch.setattr(pipe, "_drift", None)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            pipe.step(x, y)
    assert not [w for w in caught if "predicted" in str(w.message)]
    assert pipe.last_step is not None and pipe.last_step.seconds > 0  # still measured
    assert all(DriftCheck(_plan(pipe.plan), speaks=False).observe(1.0) is None
               for _ in range(5))


def _row(p: int, d: int, b: int, m: int, step: float, allreduce: float = 0.0,
         chosen: bool = False) -> Alternative:
    return Alternative(p, d, b, m, step, 0.1, allreduce, (1.0,) * p, chosen, "varuna")


def test_explain_names_what_decided_the_pick() -> None:
    rows = [_row(2, 1, 4, 4, 0.10, chosen=True), _row(1, 2, 8, 1, 0.13, allreduce=0.05)]
    text = explain_pick(rows, (("compute", 0.07), ("bubble", 0.03)), 0.1, 0.08)
    assert "picked P=2 x D=1" in text and "± 8%" in text and "compute 70.00 ms (70%)" in text
    assert "runner-up P=1 x D=2" in text and "+30.0%" in text and "all-reduce" in text
    tie = [_row(1, 2, 8, 1, 0.100, chosen=True), _row(2, 1, 1, 16, 0.099)]
    assert "tie rule" in explain_pick(tie)
    assert "nothing to weigh" in explain_pick([_row(1, 1, 8, 1, 0.1, chosen=True)])


def test_the_plan_table_shows_the_spread(pipe: vf.Pipeline) -> None:
    plan = dataclasses.replace(pipe.plan, predicted_spread=0.12)
    assert "± 12%" in str(plan)
    assert "picked" in pipe.plan.explain()
