"""Shared test helpers: run a registry case eagerly and through a pipeline, and compare."""

from __future__ import annotations

import torch

import varuna_fx as vf
from registry import Case


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
