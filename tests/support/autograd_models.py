"""Models whose forward applies a custom ``torch.autograd.Function``, written here: a
straight-through estimator (its backward passes the gradient through ``round``, whose own
gradient is zero) and a Function that writes its input in place (``ctx.mark_dirty``)."""

from __future__ import annotations

import torch
from torch import nn


class RoundSTE(torch.autograd.Function):
    """round() forward, identity backward: the straight-through estimator of quantisation."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 - torch's signature
        return x.round()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return grad


class ScaleInPlace(torch.autograd.Function):
    """x *= s in place (marked dirty), the gradient scaled by s."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, s: float) -> torch.Tensor:  # noqa: ANN001
        ctx.mark_dirty(x)
        ctx.s = s
        return x.mul_(s)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return grad * ctx.s, None


class Quantised(nn.Module):
    """Layers whose activations are quantised by the STE, then scaled in place."""

    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = RoundSTE.apply(layer(h) * 4) / 4
            h = ScaleInPlace.apply(h + 0.0, 0.5).tanh()
        return self.out(h).pow(2).mean()


class TanhOwnBackward(torch.autograd.Function):
    """tanh with its derivative written by hand, as Bloom's GeLUFunction is: the backward is
    autograd's through the forward, so inlining it loses nothing."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


class HandWritten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(TanhOwnBackward.apply(self.a(x))).pow(2).mean()
