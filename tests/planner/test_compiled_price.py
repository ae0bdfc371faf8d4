"""Compiled stages priced (issue 43 item 5, planner/compiled_speed.py): the planner's prediction
uses the compiled speed where stages run compiled; "auto" on a CPU compiles from the measured
factor by the stated rule; the factor is measured once, cached, and measured again where the
cache entry is damaged; the plan's note says it. No test here runs inductor: the factor is
stated (a machine file) or the compile call is a stand-in."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import varuna_fx as vf
from varuna_fx.examples import demo_gpt, lm_loss
from varuna_fx.planner import analyze, compiled_speed, machine
from varuna_fx.planner.compiled_speed import CompiledSpeed, CompiledTimes, decide, resolve_speed
from varuna_fx.planner.cost_table import CostTable
from varuna_fx.world.disk_cache import CacheWarning

SUITE_MACHINE = Path(__file__).parent.parent / "support" / "machine.json"


@pytest.fixture(autouse=True)
def _no_factor_in_memory() -> None:
    """The cache's memory layer outlives a test's cache folder: each test starts empty."""
    compiled_speed.CACHE.clear()


@pytest.fixture
def stated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """State a machine whose compiled stages run ``speedup`` times eager's after a compile of
    ``seconds``: the suite's machine with those two numbers."""
    def state(speedup: float | None, seconds: float = 0.5) -> None:
        data = json.loads(SUITE_MACHINE.read_text())
        data.update(compiled_speedup=speedup, compile_seconds=seconds)
        path = tmp_path / f"machine_{speedup}_{seconds}.json"
        path.write_text(json.dumps(data))
        monkeypatch.setenv("VARUNA_FX_MACHINE", str(path))
        monkeypatch.setattr(machine, "_MEASURED", {})

    return state


def _plan(setting: str, **more: Any) -> vf.Plan:
    model, x, _ = demo_gpt(n_layer=1)
    pipe = vf.compile(model, vf.Cluster(gpus=2, device="cpu"), example_inputs=(x,),
                      loss_fn=lm_loss, stages=2, micro_batch_size=2, recompute=False,
                      schedule="1f1b", compile_stages=setting, **more)
    return pipe.plan


def test_the_suite_states_no_gain_so_plans_stay_eager() -> None:
    """The stated machine of the suite: compiling gains nothing, so "auto" plans eager stages
    (no test compiles by default) and "on" is priced as eager."""
    costs = machine.from_json(SUITE_MACHINE.read_text())
    assert costs.compiled_speedup == 1.0
    plan = _plan("auto")
    assert not plan.compile_stages and "below the 1.05x" in plan.compile_note


def test_compiled_pricing_divides_times_by_the_factor(stated: Any) -> None:
    """Per node: forward and recompute over the forward factor, backward over the
    backward's, bytes unchanged; and the plan's prediction falls where compile is on."""
    stated(1.25)
    off, on = _plan("off"), _plan("on")
    assert off.compile_speedup is None and on.compile_speedup == 1.25
    assert on.predicted_step_time < off.predicted_step_time / 1.15
    assert "priced with the compiled stages' speed 1.25x" in on.compile_note
    assert "stated by $VARUNA_FX_MACHINE" in on.compile_note

    model, x, _ = demo_gpt(n_layer=1)
    graph = analyze(model, (x,))
    table = CostTable.build(graph.gm)
    eager = machine.CalibratedTimes.of(table, machine.machine_costs())
    speed = CompiledSpeed((2, 8), (1.5, 1.2), (2.0, 1.6), (1.8, 1.4), 3.0)
    compiled = CompiledTimes(list(table.names), eager, speed)
    a, c = eager.arrays(5), compiled.arrays(5)  # halfway between the sizes
    np.testing.assert_allclose(c.forward, a.forward / 1.35)
    np.testing.assert_allclose(c.recompute, a.recompute / 1.35)
    np.testing.assert_allclose(c.backward, a.backward / 1.8)
    np.testing.assert_array_equal(c.activations, a.activations)
    assert speed.at(1) == (1.5, 2.0) and speed.at(100) == (1.2, 1.6)  # nearest outside
    eager.step, eager.learn_key = 0.003, "learned-here"  # outside the actions: not compiled
    assert (compiled.step, compiled.learn_key, compiled.action) == \
        (0.003, "learned-here", eager.action)


CPU = vf.Cluster(gpus=2, device="cpu")
FAST = CompiledSpeed((8,), (1.25,), (1.25,), (1.25,), 30.0)


@pytest.mark.parametrize("setting, speed, steps, compiled, words", [
    ("off", FAST, None, False, ""),
    ("on", None, None, True, "not measured"),
    ("on", FAST, None, True, "1.25x"),
    ("auto", None, None, False, "profile=True with planned_steps measures it"),
    ("auto", dataclasses.replace(FAST, step=(1.03,)), None, False, "below the 1.05x"),
    # 10 ms a sample eager, 8 samples a step: 16 ms saved a step; 30 s pays after 1875 steps
    ("auto", FAST, None, False, "pays after 1875 steps, more than the plan's 1000"),
    ("auto", FAST, 1000, False, "planned_steps=1000"),
    ("auto", FAST, 2000, True, "pays after 1875 of the plan's 2000 steps"),
])
def test_auto_on_cpu_compiles_where_the_gain_pays_the_compile(
        setting: str, speed: CompiledSpeed | None, steps: int | None, compiled: bool,
        words: str) -> None:
    decision = decide(setting, CPU, speed, 0.010, 8, steps)
    assert decision.compiled is compiled
    assert words in decision.note
    assert (decision.speed is not None) is (compiled and speed is not None)


def test_auto_on_cuda_compiles_as_before() -> None:
    decision = decide("auto", vf.Cluster(gpus=8, device="cuda"), None, 0.0, 8, None)
    assert decision.compiled and "CUDA" in decision.note and decision.speed is None
    assert "measured on the cluster's own kind of device only" in decision.note


def test_auto_decided_on_cpu_runs_compiled_there_and_says_why(stated: Any) -> None:
    stated(1.25, 0.5)
    plan = _plan("auto")
    assert plan.compile_stages and plan.compiles_on("cpu") and plan.compile_speedup == 1.25
    assert "compile_stages='auto' on CPU" in plan.compile_note and "pays after" in plan.compile_note
    assert "1.25x" in str(plan) and "1.25x" in plan.explain()
    short = _plan("auto", planned_steps=1)
    assert not short.compile_stages and not short.compiles_on("cpu")
    assert "more than the plan's 1 (planned_steps=1)" in short.compile_note


@pytest.mark.parametrize("setting, cluster, profile, steps, measures", [
    ("on", CPU, True, None, True), ("auto", CPU, True, 600, True),
    ("auto", CPU, True, None, False),  # a plain vf.compile(profile=True): no compile to weigh
    ("on", CPU, False, None, False), ("off", CPU, True, 600, False),
    ("auto", vf.Cluster(gpus=2, device="cuda"), True, None, True),
])
def test_the_profiler_measures_only_what_it_can_weigh(setting: str, cluster: vf.Cluster,
                                                     profile: bool, steps: int | None,
                                                     measures: bool) -> None:
    assert compiled_speed.should_measure(setting, cluster, profile, steps) is measures


def test_the_train_command_plans_for_its_steps() -> None:
    from varuna_fx.train.config import TrainConfig

    assert TrainConfig(steps=1234).compile_options()["planned_steps"] == 1234


class _Counted:
    """A stand-in for the runtime's compile: the module itself, counted."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module: torch.nn.Module) -> Any:
        self.calls += 1
        return module


def _mlp_graph() -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return analyze(model, (torch.randn(8, 8),))


def test_the_factor_is_measured_once_cached_and_a_damaged_entry_measured_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VARUNA_FX_MACHINE")  # a machine of its own: measured, not stated
    graph, compile_fn = _mlp_graph(), _Counted()

    def speed(measure: bool = True) -> CompiledSpeed | None:
        return resolve_speed(graph.gm, graph.bound, "auto", CPU, measure, compile_fn)

    assert speed(measure=False) is None and compile_fn.calls == 0  # not asked: none
    first = speed()
    assert first is not None and first.source == "measured" and compile_fn.calls == 1
    assert first.sizes == (2, 8) and all(s > 0 for s in first.step)
    compiled_speed.CACHE.clear()  # a new process: from the disk
    again = speed(measure=False)
    assert again is not None and again.source == "cached" and compile_fn.calls == 1
    assert again.step == first.step
    assert resolve_speed(graph.gm, graph.bound, "off", CPU, True, compile_fn) is None

    path = compiled_speed.CACHE.path(compiled_speed.speed_key(graph.gm))
    for damage in ("{not json", json.dumps({"hmac": "0" * 64, "entry": {"speed": {}}})):
        path.write_text(damage)
        compiled_speed.CACHE.clear()
        calls = compile_fn.calls
        with pytest.warns(CacheWarning, match="ignoring the compiled cache file"):
            measured = speed()
        assert measured is not None and measured.source == "measured"
        assert compile_fn.calls == calls + 1  # measured again, and written again
        compiled_speed.CACHE.clear()
        assert speed(measure=False) is not None


def test_a_cached_factor_with_bad_numbers_is_refused() -> None:
    good = {"sizes": [2, 8], "forward": [1.1, 1.2], "backward": [1.1, 1.2],
            "step": [1.1, 1.2], "compile_seconds": 3.0}
    assert compiled_speed.speed_from_json(good).speedup == 1.2
    for bad in ({"forward": [1.1]}, {"step": [0.0, 1.2]}, {"compile_seconds": float("nan")},
                {"sizes": [8, 2]}, {"sizes": [True, 8]}, {"backward": [1.1, -1.0]}):
        with pytest.raises(ValueError, match="not a compiled speed"):
            compiled_speed.speed_from_json({**good, **bad})
    with pytest.raises(ValueError):
        machine.from_json(json.dumps({**json.loads(SUITE_MACHINE.read_text()),
                                      "compiled_speedup": -1.0}))


def test_a_model_that_fails_to_compile_is_priced_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VARUNA_FX_MACHINE")
    graph = _mlp_graph()

    def broken(module: torch.nn.Module) -> Any:
        def run(*args: Any) -> Any:
            raise RuntimeError("inductor: no kernel for aten.frobnicate")
        return run

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert resolve_speed(graph.gm, graph.bound, "on", CPU, True, broken) is None
    assert any("aten.frobnicate" in str(w.message) and "priced as eager" in str(w.message)
               for w in seen)


@pytest.mark.slow
def test_the_real_compile_is_measured_cached_and_priced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor itself (compile's own compile call): profile=True measures the compiled MLP,
    the plan is priced with that factor, and a compile again takes it from the cache."""
    monkeypatch.delenv("VARUNA_FX_MACHINE")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(16, 64)

    def plan() -> vf.Plan:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return vf.compile(model, vf.Cluster(gpus=1, device="cpu"), example_inputs=(x,),
                              loss_fn=torch.nn.functional.mse_loss, stages=1,
                              micro_batch_size=8, profile=True, compile_stages="on").plan

    first = plan()
    assert first.compile_speedup is not None and first.compile_speedup > 0
    assert "measured now" in first.compile_note
    compiled_speed.CACHE.clear()
    again = plan()
    assert again.compile_speedup == first.compile_speedup
    assert "from the cache" in again.compile_note and again.compiles_on("cpu")


def test_plan_for_prices_compiled_stages_as_compile_does(stated: Any) -> None:
    """``varuna-fx plan`` (``Analyzed.plan``) prints the plan a run gets: compiled stages
    priced by the same (stated or cached) speed, never compiling to find it."""
    from varuna_fx.planner import PlanOptions

    stated(1.25)
    model, x, _ = demo_gpt(n_layer=1)
    graph = analyze(model, (x,))

    def best(setting: str) -> float:
        options = PlanOptions(cluster=CPU, stages=2, micro_batch_size=2, recompute=False,
                              schedule="1f1b", compile_stages=setting)
        return graph.plan(options).best.step_time

    assert best("on") < best("off") / 1.15
