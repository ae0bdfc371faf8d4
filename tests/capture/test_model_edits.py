"""Edits to the model after compile (capture/model_edits.py): a pipeline never runs what was replaced, changed
or unfrozen since, and tracing leaves the model's Python state alone."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import varuna_fx as vf
from support.eager import Scaled, assert_like_eager, eager_step
from tiers import product, tiered


def test_a_pipeline_refuses_to_run_a_model_edited_after_compile() -> None:
    # the stages hold the model's own objects: after `model.b = ...` the first pipeline used
    # to run the old layer while pipe.parameters() handed the optimizer the new one
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(8, 8)
    first = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=4)
    model.a.weight = nn.Parameter(torch.randn(16, 8))  # a module the stage calls: followed
    model.zero_grad()
    loss = first.step(x)
    torch.testing.assert_close(loss, model(x).detach())
    model.act.negative_slope = 0.5  # a module the graph calls: its own code follows it
    first.step(x)
    model.alpha = 5.0  # traced into the graph as a constant
    with pytest.raises(vf.VarunaFxError, match=r"Scaled\.alpha changed from 1\.0 to 5\.0"):
        first.step(x)
    model.alpha = 1.0
    first.step(x)
    hook = model.register_forward_hook(lambda module, args, out: out * 2.0)  # traced: stale
    with pytest.raises(vf.VarunaFxError, match="hook was added to or removed from Scaled"):
        first.step(x)
    hook.remove()
    model.act.register_forward_hook(lambda module, args, out: out)  # a called module: runs
    first.step(x)
    model.b = nn.Linear(16, 16)
    with pytest.raises(vf.VarunaFxError, match=r"Scaled\.b is not the submodule.*compile again"):
        first.step(x)
    with pytest.raises(vf.VarunaFxError, match="compile again"):
        first(x)
    second = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=4)
    model.zero_grad()
    torch.testing.assert_close(second.step(x), model(x).detach())
    model.double()
    with pytest.raises(vf.VarunaFxError, match=r"float64.*compile again"):
        second.step(x.double())


def test_unfreezing_after_compile_asks_for_a_new_compile() -> None:
    # the plan decides from requires_grad at compile which values carry gradients between
    # stages: `a`, unfrozen later, silently got no gradient
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(8, 8)
    model.a.requires_grad_(False)
    pipe = vf.compile(model, example_inputs=(x,), stages=3, micro_batch_size=4)
    pipe.step(x)
    model.b.requires_grad_(False)  # freezing is followed: no gradient, as in eager
    model.zero_grad()
    pipe.step(x)
    assert model.b.weight.grad is None and model.c.weight.grad is not None
    model.requires_grad_(True)
    with pytest.raises(vf.VarunaFxError, match=r"Scaled\.a\.weight requires grad now"):
        pipe.step(x)
    pipe = vf.compile(model, example_inputs=(x,), stages=3, micro_batch_size=4)
    model.zero_grad()
    loss = pipe.step(x)
    eager = copy.deepcopy(model)
    eager.zero_grad()
    eager_loss = eager(x)
    eager_loss.backward()
    assert_like_eager(pipe, model, eager, loss, eager_loss)


class CountsCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # Python state: eager counts calls, a traced graph cannot
        h = torch.relu(self.a(x))
        return self.b(h * 2.0 if self.training else h).pow(2).mean()


@pytest.mark.parametrize("tracer", tiered(["fx", "export"], ["fx"]))
def test_tracing_leaves_python_state_alone(tracer: str) -> None:
    # each capture (compile, and eval mode's own graph) ran forward's Python: the counter
    # moved, which then looked like an edit of the model after compile
    model, x = CountsCalls(), torch.randn(8, 8)
    pipe = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=4, tracer=tracer)
    assert model.calls == 0
    pipe.eval()
    pipe(x)
    pipe.train()
    pipe.step(x)
    assert model.calls == 0


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def gate(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h * self.gate(h) + torch.tensor([0.5] * 8)  # fx keeps a _tensor_constant


class TwoGated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = _Gated()
        self.second = _Gated()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.first(x))).pow(2).mean()


def _patched(model: TwoGated, edit: str) -> None:
    if edit == "model.forward":
        model.forward = lambda x: model.head(model.first(x)).pow(2).mean()  # type: ignore
    elif edit == "block.forward":
        model.second.forward = lambda x: x  # type: ignore[method-assign]
    elif edit == "block.gate":
        model.second.gate = torch.tanh  # type: ignore[method-assign]
    elif edit == "class method":
        _Gated.gate = lambda self, h: torch.tanh(h)  # type: ignore[method-assign]
    else:  # "class"
        model.second.__class__ = type("Other", (_Gated,), {"forward": lambda self, x: x})


@pytest.mark.parametrize("edit,tracer", tiered(
    product(["model.forward", "block.forward", "block.gate", "class method", "class"],
            ["fx", "export"]),
    [("model.forward", "fx"), ("block.gate", "export"), ("class method", "fx")],
    lambda c: "-".join(c)))
def test_code_monkeypatched_after_compile_asks_for_a_new_compile(edit: str, tracer: str) -> None:
    # the graph holds the code traced at compile: the pipeline kept running the old forward
    torch.manual_seed(0)
    model, x = TwoGated(), torch.randn(8, 8)
    pipe = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=4, tracer=tracer)
    pipe.eval()
    pipe(x)  # evaluation's own capture adds nothing to the model that looks like an edit
    pipe.train()
    pipe.step(x)
    original = _Gated.gate
    try:
        _patched(model, edit)
        with pytest.raises(vf.VarunaFxError, match=r"after vf\.compile.*compile again"):
            pipe.step(x)
    finally:
        _Gated.gate = original  # type: ignore[method-assign]


def test_a_called_module_monkeypatched_after_compile_runs_its_new_code() -> None:
    # fx calls nn.Linear (call_module): the stage calls the model's object, which runs the patch
    torch.manual_seed(0)
    model, x = TwoGated(), torch.randn(8, 8)
    pipe = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=4, tracer="fx")
    model.head.forward = lambda h: h.sum(1, keepdim=True)  # type: ignore[method-assign]
    eager, eager_loss = eager_step(model, x)
    model.zero_grad()
    assert_like_eager(pipe, model, eager, pipe.step(x), eager_loss)


def test_the_check_compares_settings_as_a_dict_does() -> None:
    """The per-step check compares cut tuples (issue 40 item 7: cheaper), with a dict's
    semantics: a NaN setting is the same object, no edit; a setting of None swapped for a new
    attribute keeps the count but is an edit."""
    from varuna_fx.capture.model_edits import ModelEdits

    model = Scaled()
    model.nan, model.none = float("nan"), None
    edits = ModelEdits(model, [], traced=[""])
    edits.check()
    del model.none
    model.other = None
    with pytest.raises(vf.VarunaFxError, match="other|none"):
        edits.check()
