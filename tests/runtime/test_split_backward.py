"""Split backward (``runtime/split_backward.py``): the input pass plus the weight pass give
exactly eager's gradients, whatever the graph between the received values, the parameters and
the outputs looks like."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import varuna_fx as vf
from varuna_fx.runtime.split_backward import input_grads

Stage = Callable[[list[torch.Tensor], list[nn.Parameter]], list[torch.Tensor]]


def _tied_bias(r: list[torch.Tensor], p: list[nn.Parameter]) -> list[torch.Tensor]:
    # p[2] joins the input region at two nodes, each also the join of another parameter
    # (torch's get_param_groups then puts it into two groups: its gradient counted twice)
    return [F.linear(r[0], p[0], p[2]) + F.linear(r[1], p[1], p[2])]


def _output_outside_region(r: list[torch.Tensor], p: list[nn.Parameter]) -> list[torch.Tensor]:
    # the second output reaches p[0] without touching a received value
    x = torch.linspace(-1, 1, 24).reshape(3, 8)
    return [F.linear(r[0], p[0], p[1]), F.linear(x, p[0]) * 2]


def _tied_three_ways(r: list[torch.Tensor], p: list[nn.Parameter]) -> list[torch.Tensor]:
    # random model seed 35's last stage: one weight used inside and outside the input region
    x = torch.linspace(-1, 1, 24).reshape(3, 8)
    h = F.linear(F.linear(x * 0.5, p[1], p[2]), p[0], p[3]) + F.linear(r[1], p[4], p[5])
    out = F.linear(F.layer_norm(r[0], [8]), p[0], p[6])
    return [torch.cat([out, out], -1), h]


def _param_and_input_as_outputs(r: list[torch.Tensor],
                                p: list[nn.Parameter]) -> list[torch.Tensor]:
    return [p[0], r[0], F.linear(r[1], p[0], p[1]).tanh()]


def _chain_through_region(r: list[torch.Tensor], p: list[nn.Parameter]) -> list[torch.Tensor]:
    # the same weight at three depths of one chain: the weight pass re-runs region nodes
    # between the joins, whose share must not be added to what the input pass saved
    h = r[0]
    for k in range(3):
        h = torch.tanh(F.linear(h, p[0], p[1 + k]))
    return [h * r[1]]


GRAPHS = {"tied_bias": (_tied_bias, [(8, 8), (8, 8), (8,)]),
          "output_outside_region": (_output_outside_region, [(8, 8), (8,)]),
          "tied_three_ways": (_tied_three_ways, [(8, 8), (8, 8), (8,), (8,), (8, 8), (8,), (8,)]),
          "param_and_input_as_outputs": (_param_and_input_as_outputs, [(8, 8), (8,)]),
          "chain_through_region": (_chain_through_region, [(8, 8), (8,), (8,), (8,)])}


@pytest.mark.parametrize("name", list(GRAPHS))
def test_split_equals_one_backward(name: str) -> None:
    stage, shapes = GRAPHS[name]
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s)) for s in shapes]
    received = [torch.randn(3, 8) for _ in range(2)]
    seeds: list[torch.Tensor] = []
    want: list[torch.Tensor] = []
    for mb in range(2):  # two micro-batches: the weight pass adds into what is there
        leaves = [x.add(mb).requires_grad_() for x in received]
        outs = stage(leaves, params)
        if not seeds:
            seeds = [torch.randn_like(o) for o in outs]
        want.append(torch.autograd.grad(outs, leaves + params, seeds, allow_unused=True))
    expected = [sum(w[i] for w in want if w[i] is not None) for i in range(2, 2 + len(params))]
    deferred = []
    for mb in range(2):
        leaves = [x.add(mb).requires_grad_() for x in received]
        deferred.append(input_grads(stage(leaves, params), seeds, leaves, params))
        for leaf, w in zip(leaves, want[mb][:2]):  # the input pass alone: input gradients
            torch.testing.assert_close(leaf.grad, w if w is not None else None)
        assert all(p.grad is None for p in params), "the input pass wrote a weight gradient"
    for d in reversed(deferred):  # weight passes in another order than the input passes
        d.run()
    for k, (p, e) in enumerate(zip(params, expected)):
        torch.testing.assert_close(p.grad, e, msg=lambda m, k=k: f"param {k}: {m}")


class _Tied(nn.Module):
    """Random model seed 35 in small: one weight used by three layers, one of them after a
    stage boundary and fed only by the model input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin0, self.lin1, self.lin2 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.lin3, self.lin5 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.lin3.weight = self.lin5.weight = self.lin0.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1 = self.lin0(x)
        h5 = self.lin1((h1 - h1.mean(-1, keepdim=True)) * 2.0)
        h9 = self.lin3(self.lin2(x * 0.5)) + h5
        return (torch.cat([self.lin5(self.norm(h1))] * 2, -1).sum(-1) + h9.sum(-1)).mean()


@pytest.mark.parametrize("schedule", ["gpipe-zb", "1f1b-zb", "varuna-zb"])
def test_tied_weight_across_region_matches_eager(schedule: str) -> None:
    torch.manual_seed(0)
    model = _Tied()
    x = torch.randn(4, 3, 8)
    model(x).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    pipe = vf.compile(model, example_inputs=(x,), stages=2, schedule=schedule,
                      micro_batch_size=1, recompute=False)
    assert [len(list(s.module.parameters())) for s in pipe.stages] != [0, 0]
    pipe.step(x)
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], msg=lambda m, n=n: f"{n}: {m}")
