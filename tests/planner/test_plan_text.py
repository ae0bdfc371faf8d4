"""``str(plan)`` shows every cell whole (issue 42 item 12): a narrow console wraps a cell, a
string (not a terminal) is as wide as the table, and nothing is cut to "powersg…"."""

from __future__ import annotations

import dataclasses
import io
import warnings

import pytest
import torch
from rich.console import Console
from torch import nn

import varuna_fx as vf


def _wide_plan() -> vf.Plan:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    pipe = vf.compile(model, example_inputs=(torch.randn(4, 8),), stages=2,
                      micro_batch_size=2, loss_fn=lambda out, _: out.pow(2).mean())
    sync = vf.PowerSGD(rank=4, start_iter=2)
    # two replicas, each stage with a long replica-sync name: the widest table the plan makes
    return dataclasses.replace(pipe.plan, data_parallel=2, replica_sync=(sync, sync),
                               model_name="a model with a rather long name " * 3)


def test_str_of_a_plan_shows_every_cell_whole() -> None:
    plan = _wide_plan()
    text = str(plan)
    assert "…" not in text and "..." not in text
    assert text.count("powersgd(rank=4)") == 2
    narrow = io.StringIO()  # a narrow terminal: cells wrap, never end in an ellipsis
    Console(file=narrow, width=60, color_system=None).print(plan)
    assert "…" not in narrow.getvalue()


def test_fp16_on_a_cpu_warns_once_at_the_first_step_and_bf16_does_not() -> None:
    """Issue 42 item 12: fp16 autocast on a CPU is many times slower than fp32 (no fast fp16
    kernels there): said once per pipeline, with what to use instead."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    pipe = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=2,
                      loss_fn=lambda out, _: out.pow(2).mean(), precision="fp16")
    with pytest.warns(UserWarning, match=r"fp16.*CPU.*slower.*'bf16'") as got:
        pipe.step(x)
    assert sum("fp16" in str(w.message) for w in got) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.step(x)
        bf16 = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=2,
                          loss_fn=lambda out, _: out.pow(2).mean(), precision="bf16")
        bf16.step(x)
