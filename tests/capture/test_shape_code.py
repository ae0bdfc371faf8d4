"""torch.fx follows shapes (capture/shape_values.py, issue 40 item 5): Python that needs a
size, a bool of one or a device is given the example's value where it is the same at every
batch size; one that depends on the batch size is refused, saying so."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import varuna_fx as vf


class ShapeCode(nn.Module):
    """nanoGPT's and torchtitan's shape Python: an assert on the sequence length, B, T, C =
    x.size(), a device branch, and RoPE's reshape(*x.shape[:-1], -1, 2) into view_as_complex."""

    def __init__(self) -> None:
        super().__init__()
        self.block_size = 8
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        assert T <= self.block_size, f"sequence of {T} is longer than {self.block_size}"
        if x.device.type in ("cpu", "mps"):
            x = x * 2
        h = self.a(x).view(B, T, C)
        z = torch.view_as_complex(h.float().reshape(*h.shape[:-1], -1, 2))
        h = torch.view_as_real(z * z).flatten(2)
        return self.b(h).pow(2).mean()


class BatchBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(0) > 2:
            return self.lin(x).sum()
        return self.lin(x).mean()


def test_shape_python_traces_with_fx_and_trains_like_eager() -> None:
    torch.manual_seed(0)
    model, x = ShapeCode(), torch.randn(4, 6, 4)
    eager = copy.deepcopy(model)
    want = eager(x)
    want.backward()
    # stopped by the assert, the unpacking or *h.shape[:-1] before ("control flow that
    # depends on tensor values")
    pipe = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=2, tracer="fx")
    torch.testing.assert_close(torch.as_tensor(pipe.step(x)), want.detach())
    grads = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=name)


def test_a_condition_on_the_batch_size_is_refused_saying_so() -> None:
    with pytest.raises(vf.CaptureError, match=r"x\.size\(0\) > 2.*depends on the batch size "
                       r"\(dim 0\).*decides on the batch size"):
        vf.compile(BatchBranch(), example_inputs=(torch.randn(4, 4),), stages=1, tracer="fx")


def test_a_condition_on_tensor_values_still_says_so() -> None:
    class Values(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return h.sum() if h.mean() > 0 else -h.sum()

    with pytest.raises(vf.CaptureError, match="depends on tensor values"):
        vf.compile(Values(), example_inputs=(torch.randn(4, 4),), stages=1, tracer="fx")


class CountsHits(nn.Module):
    """Reads the size of a nonzero result: only its bound is known before it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        hits = (h > 0).nonzero()
        return (h * hits.shape[0]).pow(2).mean()


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_size_that_depends_on_values_is_read_when_the_stage_runs(tracer: str) -> None:
    torch.manual_seed(0)
    model, x = CountsHits(), torch.randn(4, 4)
    eager = copy.deepcopy(model)
    want = eager(x)
    pipe = vf.compile(model, example_inputs=(x,), stages=1, micro_batch_size=4, tracer=tracer)
    # the shape pass prices nonzero at its bound (all 16 kept); the count is not that bound
    assert int((eager.lin(x) > 0).sum()) != 16
    torch.testing.assert_close(torch.as_tensor(pipe.step(x)), want.detach())


def test_shape_python_after_batchnorm_traces_and_leaves_the_statistics_alone() -> None:
    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.bn(self.lin(x))  # a batch of one fails BatchNorm in training
            assert h.shape[1] == 4
            return h.pow(2).mean()

    model = Normed()
    stats = model.bn.running_mean.clone(), model.bn.num_batches_tracked.clone()
    vf.compile(model, example_inputs=(torch.randn(8, 4),), stages=1, micro_batch_size=8,
               tracer="fx")
    assert torch.equal(model.bn.running_mean, stats[0])
    assert torch.equal(model.bn.num_batches_tracked, stats[1])
