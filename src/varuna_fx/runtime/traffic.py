"""Bytes this process sends, counted where messages and collectives start.

``pipe.last_step.bytes_sent`` is the difference of :data:`SENT` over a step. Point-to-point
sends count their tensor's bytes; a collective counts what each member sends under the ring
algorithm the planner prices (``planner/network.py``): an all-reduce ``2 (n-1)/n`` of the
buffer, a reduce-scatter or all-gather ``(n-1)/n`` of the whole buffer, a broadcast the buffer
once from its root. Tiny scalars (the loss, a gradient norm) are not counted. One integer
addition per message: nothing measurable next to the message itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class Counter:
    """A running total of bytes sent (one per process: :data:`SENT`)."""

    def __init__(self) -> None:
        self.total = 0

    def send(self, tensor: torch.Tensor) -> None:
        self.total += tensor.numel() * tensor.element_size()

    def all_reduce(self, tensor: torch.Tensor, group: Any) -> None:
        n = _size(group)
        self.total += 2 * (n - 1) * tensor.numel() * tensor.element_size() // n

    def scatter_or_gather(self, whole: torch.Tensor, group: Any) -> None:
        """A reduce-scatter of ``whole`` or an all-gather into it."""
        n = _size(group)
        self.total += (n - 1) * whole.numel() * whole.element_size() // n

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if dist.get_rank() == src:
            self.total += tensor.numel() * tensor.element_size()


def _size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


SENT = Counter()
