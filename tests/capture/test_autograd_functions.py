"""A custom torch.autograd.Function keeps its own backward (capture/autograd_functions.py):
torch.fx keeps it as one call, torch.export (which would inline its forward) refuses it."""

from __future__ import annotations

import copy

import pytest
import torch

import varuna_fx as vf
from support.autograd_models import HandWritten, Quantised
from tiers import tiered


def _eager(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    eager = copy.deepcopy(model)
    loss = eager(x)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in eager.named_parameters()}


@pytest.mark.parametrize("tracer,stages", tiered(
    [("auto", 2), ("fx", 4), ("auto", 4), ("fx", 2)], [("auto", 2), ("fx", 4)]))
def test_a_straight_through_estimator_and_an_in_place_function_train_like_eager(
        tracer: str, stages: int) -> None:
    torch.manual_seed(0)
    model, x = Quantised(), torch.randn(8, 4)
    want_loss, want = _eager(model, x)
    assert any(g.abs().sum() > 0 for g in want.values())
    pipe = vf.compile(model, example_inputs=(x,), stages=stages, micro_batch_size=2,
                      tracer=tracer)
    assert pipe.plan.stages == stages
    assert "RoundSTE_apply(" in "".join(s.code for s in pipe.stages)
    torch.testing.assert_close(torch.as_tensor(pipe.step(x)), want_loss)
    for name, p in model.named_parameters():
        # inlined, the STE's gradient would be round()'s: zero below it
        torch.testing.assert_close(p.grad, want[name], msg=name)


def test_export_refuses_a_custom_function_instead_of_dropping_its_backward() -> None:
    with pytest.raises(vf.CaptureError, match=r"RoundSTE \(.*autograd_models\.py:\d+\).*"
                       r"drops its backward.*other gradients than autograd.*tracer='fx'"):
        vf.compile(Quantised(), example_inputs=(torch.randn(8, 4),), stages=2,
                   tracer="export")


def test_export_inlines_a_function_whose_backward_is_autograds() -> None:
    # Bloom's GeLUFunction: a derivative written by hand; refusing it would lose the model
    torch.manual_seed(0)
    model, x = HandWritten(), torch.randn(8, 4)
    want_loss, want = _eager(model, x)
    pipe = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=2,
                      tracer="export")
    torch.testing.assert_close(torch.as_tensor(pipe.step(x)), want_loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], msg=name)
