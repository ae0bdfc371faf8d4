"""vf.compile's options are one frozen object, checked once when made; its fields and defaults
are exactly compile's keywords."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import varuna_fx as vf
from varuna_fx.options import CompileOptions
from varuna_fx.planner.options import PlanOptions
from varuna_fx.runtime.options import RunOptions


def test_the_options_are_compiles_keywords_with_its_defaults() -> None:
    keywords = {name: p.default for name, p in inspect.signature(vf.compile).parameters.items()
                if name not in ("model", "example_inputs")}
    fields = {f.name: f.default for f in dataclasses.fields(CompileOptions)}
    assert fields == keywords


def test_options_are_frozen_and_checked_when_made() -> None:
    options = CompileOptions(stages=2, schedule="1f1b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.stages = 3  # type: ignore[misc]
    for bad, words in [({"stages": True}, "stages=True"), ({"schedule": "zigzag"}, "unknown"),
                       ({"tracer": "jit"}, "unknown"), ({"recompute": 1}, "recompute=1"),
                       ({"timeout": -1}, "timeout=-1"), ({"cluster": (1, 2)}, "vf.Cluster"),
                       ({"loss_fn": 3}, "not callable"), ({"precision": "fp8"}, "fp8")]:
        with pytest.raises(vf.VarunaFxError, match=words):
            CompileOptions(**bad)


def test_a_planning_part_and_a_running_part_each_taken_whole() -> None:
    """A new option is a field of the part that reads it and a keyword of compile (the test
    above): CompileOptions is the two parts and the tracer, and hands each part its fields."""
    planning = {f.name for f in dataclasses.fields(PlanOptions)}
    running = {f.name for f in dataclasses.fields(RunOptions)}
    assert {f.name for f in dataclasses.fields(CompileOptions)} == planning | running | {"tracer"}
    options = CompileOptions(stages=2, schedule="1f1b", offload_stash=True, timeout=9.0)
    assert options.planning == PlanOptions(stages=2, schedule="1f1b", timeout=9.0)
    assert options.running == RunOptions(offload_stash=True, timeout=9.0)
    assert RunOptions(global_batch_size=8).replica_batch(2) == 4
    with pytest.raises(vf.VarunaFxError, match="stages=0"):
        PlanOptions(stages=0)  # each part checks its fields when made
    with pytest.raises(vf.VarunaFxError, match="precision='fp8'"):
        RunOptions(precision="fp8")
