"""The step's overhead outside its actions, learned from the first steps (issue 41, items 1
and 5; planner/learned.py): measured from the timeline, kept by rank 0 under the graph and
world, added to every prediction after, stable under small changes."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import varuna_fx as vf
from varuna_fx.planner import learned, machine


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.layers(x), y)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)


@pytest.fixture
def learning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans learn (the suite states its machine, which turns learning off); the process's
    memory of learned values starts empty."""
    monkeypatch.setattr(machine, "learns", lambda: True)
    learned.CACHE.clear()


def test_outside_actions_is_the_step_less_the_union_of_its_actions() -> None:
    line = [(0, "F", 0, 0.010, 0.030), (0, "wait", 1, 0.025, 0.040),  # overlapping
            (0, "B", 0, 0.050, 0.070), (0, "send", 0, 0.055, 0.060)]  # nested
    assert learned.outside_actions(0.100, line) == pytest.approx(0.100 - 0.030 - 0.020)
    assert learned.outside_actions(0.010, line) == 0.0  # never negative
    assert learned.outside_actions(0.1, []) == pytest.approx(0.1)


def test_the_learner_skips_warm_up_and_keeps_the_median(learning: None) -> None:
    key = learned.learn_key("graph-a", 2, 2, "cpu", 1, "float32")
    learner = learned.StepLearner(key)
    action = [(0, "F", 0, 0.0, 0.010)]
    # warm-up, then 3, 9, 2, 40, 4 ms outside the action, then a step after it is done
    said = [learner.observe(s, action) for s in (0.5, 0.013, 0.019, 0.012, 0.05, 0.014, 0.9)]
    assert said[:5] == [None] * 5 and said[6] is None
    assert said[5] == pytest.approx(0.004)  # their median (a slow step does not move it)
    assert learned.recall(key) == pytest.approx(0.004)
    # a rank that is not 0, or a plan that learns nothing, keeps nothing
    other = learned.learn_key("graph-b", 2, 2, "cpu", 1, "float32")
    for learner in (learned.StepLearner(other, keeps=False), learned.StepLearner(None)):
        assert [learner.observe(0.02, action) for _ in range(5)] == [None] * 5
    assert learned.recall(other) is None


def test_a_kept_value_moves_only_when_far_off(learning: None) -> None:
    key = learned.learn_key("graph-c", 2, 2, "cpu", 1, "float32")
    assert learned.remember(key, 0.005)
    assert not learned.remember(key, 0.0058)  # within 2x (and 1 ms): kept as it was
    assert learned.recall(key) == 0.005
    assert learned.remember(key, 0.02)  # 4x: the first run was wrong, replaced
    assert learned.recall(key) == 0.02
    assert not learned.remember(None, 0.01)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "0.1", True, 1e9])
def test_a_damaged_entry_is_ignored(learning: None, bad: object) -> None:
    key = learned.learn_key("graph-d", 2, 2, "cpu", 1, "float32")
    assert learned.remember(key, 0.004)
    learned.CACHE.clear()  # read from disk
    path = learned.CACHE.path(key)
    from varuna_fx.world.disk_cache import sealed, unsealed

    entry = unsealed(path.read_bytes())
    entry["seconds"] = bad
    path.write_text(sealed(json.loads(json.dumps(entry))))
    with pytest.warns(Warning, match="ignoring"):
        assert learned.recall(key) is None


@pytest.mark.filterwarnings("ignore:the step took")
def test_compile_learns_and_prices_what_it_learned(learning: None) -> None:
    x, y = _inputs()
    pipe = vf.compile(Regression(), example_inputs=(x, y), micro_batch_size=4)
    first = dict(pipe.plan.cost_terms)
    assert first["step overhead"] == 0.0  # one process, nothing learned: nothing estimated
    assert pipe.plan.learn_key is not None
    for _ in range(1 + learned.STEPS):
        pipe.step(x, y)
    kept = learned.recall(pipe.plan.learn_key)
    assert kept is not None and kept > 0
    again = vf.compile(Regression(), example_inputs=(x, y), micro_batch_size=4)
    assert again.plan.learn_key == pipe.plan.learn_key
    assert dict(again.plan.cost_terms)["step overhead"] == pytest.approx(kept)
    assert again.plan.predicted_step_time == pytest.approx(
        pipe.plan.predicted_step_time + kept, rel=1e-6)


def test_a_stated_machine_learns_nothing() -> None:
    x, y = _inputs()  # (the suite states its machine: $VARUNA_FX_MACHINE)
    pipe = vf.compile(Regression(), example_inputs=(x, y), micro_batch_size=4)
    assert pipe.plan.learn_key is None


def test_a_distributed_step_is_estimated_from_the_links_before_it_is_learned() -> None:
    from varuna_fx.world.network import NetworkProfile

    net = NetworkProfile(latency=5e-5, bandwidth=1e9, allreduce_latency=3e-4,
                         allreduce_bandwidth=1e9)
    assert learned.estimated_step_overhead(2, net) == pytest.approx(3e-4)
    assert learned.estimated_step_overhead(1, net) == 0.0
    assert learned.estimated_step_overhead(4, None) == 0.0
