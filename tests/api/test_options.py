"""vf.compile's options are one frozen object, checked once when made; its fields and defaults
are exactly compile's keywords."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import varuna_fx as vf
from varuna_fx.options import CompileOptions


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
