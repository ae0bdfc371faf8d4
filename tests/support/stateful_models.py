"""Models whose forward writes buffers, shared by capture/test_written_buffers.py and the
three-rank script (dist_scripts/written_buffers.py)."""

from __future__ import annotations

import torch
from torch import nn


class RebindsBuffers(nn.Module):
    def __init__(self, twice: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 1)
        self.register_buffer("ema", torch.zeros(16))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.twice = twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.twice:  # two in-place writes: a stage may not receive the buffer between them
            self.ema.mul_(0.9).add_(h.detach().mean(0) * 0.1)
        else:  # fx proxies have no in-place operators: these rebind the attribute
            self.steps += 1
            self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)
        h = torch.relu(self.b(h)) + self.ema
        return self.c(h).pow(2).mean()


class ReadsThenWrites(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.calls.float()  # read before the write, used on the last stage
        self.calls.add_(1)
        return (self.c(self.b(self.a(x))) * scale).pow(2).mean()


class DetachedAcross(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 1)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        stat = h.detach().mean(dim=0) * 0.1  # made on the first stage, written on the last
        h = self.c(torch.relu(self.b(torch.relu(h))))
        self.ema.mul_(0.9).add_(stat)
        return self.d(h + self.ema).pow(2).mean()


WRITTEN_BUFFER_MODELS = {"rebinds": RebindsBuffers, "reads_then_writes": ReadsThenWrites,
                         "detached_across": DetachedAcross}


WRITTEN_BUFFER_JOBS = [("rebinds", "fx"), ("rebinds", "export"), ("reads_then_writes", "fx"),
                       ("detached_across", "export")]
