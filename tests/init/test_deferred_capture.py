"""Capture of a vf.deferred_init model traces on fake tensors of the inputs' device (issue 40
item 3): a model computing its own loss from targets captures, constants forward makes from
Python values are captured with their values, and device branches take the run-time branch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import varuna_fx as vf
from tiers import tiered


class LastPosition(nn.Module):
    """nanoGPT's contract: forward(idx, targets) -> (logits, loss), ignore_index=-1, and the
    last-position shortcut x[:, [-1], :] (an index list torch.export lifts into a constant)
    when targets is None."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lin = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = torch.tanh(self.emb(idx))
        if targets is None:
            return self.lin(x[:, [-1], :]), None
        logits = self.lin(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                       ignore_index=-1)


class DeviceBranch(nn.Module):
    """Code that branches on the device, as transformers' MoE routing does: traced on meta,
    the other branch ran on CPU (a silently different loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lin = nn.Embedding(16, 8), nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.emb(ids))
        if h.device.type in ("cpu", "mps"):
            h = h * 2 + torch.ones(h.shape[-1], device=h.device)
        return h.pow(2).mean()


def _deferred(cls: type[nn.Module]) -> nn.Module:
    with vf.deferred_init(seed=3):
        return cls()


def _check(cls: type[nn.Module], inputs: tuple, tracer: str, loss_fn=None, **kw) -> None:
    eager = vf.materialize(_deferred(cls))  # the values the pipeline's stages get
    out = eager(*inputs)
    want = loss_fn(out) if loss_fn else out
    want.backward()
    pipe = vf.compile(_deferred(cls), example_inputs=inputs, stages=2, tracer=tracer,
                      loss_fn=loss_fn, **kw)
    torch.testing.assert_close(torch.as_tensor(pipe.step(*inputs)), want.detach())
    grads = dict(eager.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=name)


IDS = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(0))
TARGETS = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tracer", tiered(["export", "auto"], ["export"]))
def test_a_deferred_model_computing_its_own_loss_from_targets_trains_like_eager(tracer):
    # traced on meta, export failed: "Tensor on device meta is not on the expected device cpu"
    _check(LastPosition, (IDS, TARGETS), tracer, loss_fn=lambda out: out[1],
           micro_batch_size=4)


def test_a_constant_forward_makes_from_python_values_is_captured_with_its_values():
    # x[:, [-1], :]: a lifted index constant, meta (and refused) when traced on meta
    _check(LastPosition, (IDS,), "export", loss_fn=lambda out: out[0].pow(2).mean(),
           micro_batch_size=2)


@pytest.mark.parametrize("tracer", tiered(["export", "auto"], ["auto"]))
def test_a_device_branch_takes_the_branch_of_the_device_the_stage_runs_on(tracer):
    _check(DeviceBranch, (IDS,), tracer, micro_batch_size=2)
