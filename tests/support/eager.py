"""Eager references: run a registry case or a model eagerly and through a pipeline, and
compare."""

from __future__ import annotations

import copy

import torch
from torch import nn

import varuna_fx as vf
from support.registry import Case


def call_args(case: Case) -> tuple[tuple, dict]:
    if isinstance(case.inputs, tuple):
        return case.inputs, {}
    return (), dict(case.inputs)


def eager_grads(case: Case) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    case.model.zero_grad(set_to_none=True)
    loss = case.eager_loss()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in case.model.named_parameters() if p.grad is not None}
    case.model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_grads_equal(pipe: vf.Pipeline, expected: dict[str, torch.Tensor], **tol: float) -> None:
    names = []
    for name, param in pipe.named_parameters():
        names.append(name)
        if name not in expected:
            assert param.grad is None or not param.grad.any(), f"{name} has an unexpected grad"
            continue
        assert param.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(param.grad, expected[name], msg=lambda m, n=name: f"{n}: {m}", **tol)
    missing = set(expected) - set(names)
    assert not missing, f"parameters missing from pipe.named_parameters(): {missing}"


def eager_step(model: nn.Module, *inputs: torch.Tensor) -> tuple[nn.Module, torch.Tensor]:
    """A copy of ``model`` (taken before any compile touches it) after eager forward and
    backward on ``inputs``, with its loss: what a pipeline's step must match."""
    eager = copy.deepcopy(model)
    loss = eager(*inputs)
    loss.backward()
    return eager, loss


def assert_like_eager(pipe: vf.Pipeline, model: nn.Module, eager: nn.Module, loss: torch.Tensor,
                      eager_loss: torch.Tensor) -> None:
    torch.testing.assert_close(loss, eager_loss.detach())
    want = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, msg=lambda m, n=name: f"{n}: {m}")
    buffers = dict(eager.named_buffers())
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, buffers[name], msg=lambda m, n=name: f"{n}: {m}")


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.act: nn.Module = nn.ReLU()
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 1)
        self.alpha = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.c(self.b(self.act(self.a(x)))) * self.alpha).pow(2).mean()
