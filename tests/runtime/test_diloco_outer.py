"""DiLoCo's outer step over its whole documented momentum range [0, 1), in one process."""

from __future__ import annotations

import torch
from torch import nn

import varuna_fx as vf
from varuna_fx.runtime.sync.diloco import DiLoCoSync


def _outer_once(momentum: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One outer step of one replica (nothing to all-reduce) after an inner move of ``p``;
    returns the parameter after it and what plain torch SGD gives on the same outer gradient."""
    p = nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    sync = DiLoCoSync(vf.DiLoCo(every=1, outer_lr=0.5, outer_momentum=momentum), {"w": p},
                      group=None, replicas=1, timeout=5.0, who="test")
    sync.before_inner_step()
    with torch.no_grad():
        p.sub_(torch.tensor([0.2, 0.4, -0.6]))  # the inner step's move
    sync.after_inner_step()  # every=1: the outer step
    ref = nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    ref.grad = torch.tensor([0.2, 0.4, -0.6])  # anchor - theta
    torch.optim.SGD([ref], lr=0.5).step()
    return p.detach(), ref.detach()


def test_zero_outer_momentum_is_plain_sgd() -> None:
    """outer_momentum=0.0 is in the range DiLoCo accepts: the outer step is plain SGD (torch's
    Nesterov refuses a zero momentum, so it is not asked for there)."""
    got, want = _outer_once(0.0)
    torch.testing.assert_close(got, want)


def test_first_nesterov_step_with_momentum() -> None:
    """With momentum the first outer step is Nesterov's: g + m*g (the buffer starts at g)."""
    got, _ = _outer_once(0.9)
    want = torch.tensor([1.0, -2.0, 3.0]) - 0.5 * 1.9 * torch.tensor([0.2, 0.4, -0.6])
    torch.testing.assert_close(got, want)
