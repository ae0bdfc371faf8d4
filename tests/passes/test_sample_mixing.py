"""Computation that mixes samples along the batch: warned when micro-batching changes it.

Each model below computes something micro-batches cannot reproduce; the pipeline warns once at
compile (or, for a ``loss_fn``, at the first step), naming the line, when more than one
micro-batch runs, and stays silent with one micro-batch or with per-sample computation."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import varuna_fx as vf
from support.registry import registry
from tiers import tiered
from varuna_fx.capture.buffers import MicroBatchStateWarning
from varuna_fx.passes.sample_mixing import LINEAR, MEAN, OTHER, Op, find_sample_mixing


class Centered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h - h.mean(0)).pow(2).mean()  # MIX


class SummedOverBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).sum(0).pow(2).mean()  # MIX


class PlusPositions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a(x) + torch.arange(x.shape[0]).unsqueeze(1)).pow(2).mean()  # MIX


class FunctionalBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(self.a(x), None, None, training=True).pow(2).mean()  # MIX


class InBatchContrastive(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.c(self.a(x)) @ self.b(x).t()  # MIX
        return F.cross_entropy(logits, torch.arange(x.shape[0]))


MIXING = [Centered, SummedOverBatch, PlusPositions, FunctionalBatchNorm, InBatchContrastive]


def _compile(model: nn.Module, micro_batch_size: int, **kw) -> tuple[vf.Pipeline, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = vf.compile(model, example_inputs=(torch.randn(8, 8),),
                          micro_batch_size=micro_batch_size, **kw)
    return pipe, [str(w.message) for w in caught if w.category is MicroBatchStateWarning]


def _mix_line(cls: type) -> int:
    import inspect
    lines, start = inspect.getsourcelines(cls.forward)
    return start + next(i for i, line in enumerate(lines) if "# MIX" in line)


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("cls", MIXING, ids=lambda c: c.__name__)
def test_mixing_samples_warns_once_naming_the_line(cls: type, tracer: str) -> None:
    torch.manual_seed(0)
    _, messages = _compile(cls(), 2, stages=1, tracer=tracer)
    assert len(messages) == 1, messages
    assert f"test_sample_mixing.py:{_mix_line(cls)}" in messages[0]
    assert "4 micro-batches" in messages[0] and "micro_batch_size" in messages[0]
    _, silent = _compile(cls(), 8, stages=1, tracer=tracer)
    assert silent == []


# what the graph computes, not a list of ops (issue 30): each mixes samples along the batch
# without being a mean, a product or positions
MEASURED = {
    "cumsum": lambda h: h.cumsum(0),
    "cummax": lambda h: h.cummax(0).values,
    "sort": lambda h: h.sort(0).values,
    "flip": lambda h: h.flip(0),
    "roll": lambda h: h.roll(1, 0),
    "gather": lambda h: h.gather(0, torch.zeros_like(h, dtype=torch.long)),
    "layer_norm_t": lambda h: F.layer_norm(h.t(), (h.shape[0],)).t(),
    "softmax_t": lambda h: h.t().softmax(-1).t(),
    "flat_softmax": lambda h: h.reshape(-1).softmax(0).view_as(h),
}
# ... and per-sample computation through the same views: silent
PER_SAMPLE = {
    "softmax_t0": lambda h: h.t().softmax(0).t(),
    "flat_rows": lambda h: h.reshape(-1).view(h.shape[0], -1).softmax(-1),
    "own_rows": lambda h: h[torch.arange(h.shape[0]), :],
    "sort_scatter_back": lambda h: torch.empty_like(h).index_copy(
        0, h[:, 0].argsort(), (h[h[:, 0].argsort()] * 2)),  # rows moved and put back
}


class Applies(nn.Module):
    def __init__(self, fn) -> None:  # noqa: ANN001
        super().__init__()
        self.a, self.b, self.fn = nn.Linear(8, 8), nn.Linear(8, 8), fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)  # (a reordering alone would be undone by the mean: added to h it is not)
        return self.b(self.fn(h) + h).pow(2).mean()


@pytest.mark.parametrize("name", tiered(MEASURED, ["cumsum", "flip", "layer_norm_t"]))
def test_mixing_found_by_running_the_graph_warns(name: str) -> None:
    torch.manual_seed(0)
    _, messages = _compile(Applies(MEASURED[name]), 2, stages=1)
    assert len(messages) == 1, messages
    assert "makes one sample's values from other samples'" in messages[0]
    assert f"test_sample_mixing.py:{_measured_line(name)}" in messages[0]
    _, silent = _compile(Applies(MEASURED[name]), 8, stages=1)
    assert silent == []


def _measured_line(name: str) -> int:
    import inspect
    lines, start = inspect.getsourcelines(inspect.getmodule(Applies))
    return next(i + 1 for i, line in enumerate(lines) if f'"{name}": lambda' in line)


@pytest.mark.parametrize("name", tiered(PER_SAMPLE, ["sort_scatter_back"]))
def test_per_sample_computation_through_views_and_reorderings_is_silent(name: str) -> None:
    torch.manual_seed(0)
    model = Applies(PER_SAMPLE[name])
    pipe, messages = _compile(model, 2, stages=1)
    assert messages == []
    x = torch.randn(8, 8)
    torch.testing.assert_close(torch.as_tensor(pipe.step(x)), model(x).detach())


@pytest.mark.slow
def test_per_sample_models_do_not_warn() -> None:
    """The registry (GPT, MLP, convs, HF models) computes per sample: no warning."""
    for case in registry():
        if case.batch_size < 2 or "batchnorm" in case.name.lower():
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            args = case.inputs if isinstance(case.inputs, tuple) else ()
            kwargs = case.inputs if isinstance(case.inputs, dict) else {}
            vf.compile(case.model, example_inputs=args or kwargs, loss_fn=case.loss_fn,
                       micro_batch_size=1, stages=1, tracer=case.tracer)
        mixing = [str(w.message) for w in caught if w.category is MicroBatchStateWarning
                  and "BatchNorm" not in str(w.message)]
        assert mixing == [], (case.name, mixing)


def test_batch_x_batch_boundary_is_never_negative_and_steps_like_eager() -> None:
    """A (b, b) tensor's bytes grow as b**2: a line through two batch sizes went negative for
    small micro-batches (a ScheduleError about negative link times at P=2)."""
    torch.manual_seed(0)
    model = InBatchContrastive()
    x = torch.randn(8, 8)
    pipe, _ = _compile(model, 2, stages=2)
    assert all(c.boundary_bytes >= 0 for c in pipe.plan.stage_costs)
    pipe.step(x)
    whole, _ = _compile(model, 8, stages=2)
    torch.testing.assert_close(torch.as_tensor(whole.step(x)), model(x).detach())


def _two_heads() -> nn.Module:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.a(x), self.b(x)
    return TwoHeads()


def contrastive_loss(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    za, zb = out
    return F.cross_entropy(za @ zb.t(), torch.arange(za.shape[0]))


def per_sample_loss(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out[0], y) + 0.5 * out[1].pow(2).mean()


@pytest.mark.parametrize("loss_fn,warns", [(contrastive_loss, True), (per_sample_loss, False)])
def test_a_loss_fn_mixing_samples_warns_at_the_first_step(loss_fn, warns: bool) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = vf.compile(_two_heads(), example_inputs=(x,), micro_batch_size=2, stages=2,
                      loss_fn=loss_fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.step(x, target=y)
        pipe.step(x, target=y)
    messages = [str(w.message) for w in caught if w.category is MicroBatchStateWarning]
    assert len(messages) == warns, messages
    if warns:
        assert messages[0].startswith("loss_fn multiplies samples with samples")
        assert "test_sample_mixing.py" in messages[0]


def test_the_analysis_is_a_pure_function_over_ops() -> None:
    # x (batch) -> mean over the batch -> output: a mean reaching the loss is exact
    mean = Op("mean", MEAN, (0,), 1, (1,), 0)
    assert find_sample_mixing([mean], [1]) == []
    # ... scaled by a constant: still exact; squared (a product of two batch statistics): not
    scaled = Op("mul", "product", (1, 9), 2, (0, -1), 0)
    assert find_sample_mixing([mean, scaled], [2]) == []
    squared = Op("mul", "product", (1, 1), 2, (0, 0), 0)
    assert [f.op for f in find_sample_mixing([mean, squared], [2])] == ["mean"]
    # a sum over the batch reaching the loss; a mean fed back into per-sample values
    summed = Op("sum", OTHER, (0,), 1, (1,), 0)
    assert [f.op for f in find_sample_mixing([summed], [1])] == ["sum"]
    back = Op("sub", LINEAR, (0, 1), 2, (1, 0), 1)
    found = find_sample_mixing([mean, back], [2])
    assert [f.op for f in found] == ["mean"] and "per-sample values" in found[0].reason
