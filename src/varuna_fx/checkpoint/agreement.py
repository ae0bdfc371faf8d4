"""Collective checks on the checkpoint process group: every rank learns whether any failed.

A bad argument may show on one rank only (``extra`` is rank 0's, the destination directory is
prepared by rank 0): every rank must learn of it before a collective save or load, or the
others would wait for that rank in vain.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..errors import CheckpointError


class Agreement:
    """The ranks of one checkpoint process group (``group`` None: one process)."""

    def __init__(self, group: Any, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world

    def agree(self, error: BaseException | None, what: str) -> None:
        """A barrier that also tells every rank whether any rank failed (and raises there)."""
        if self.group is None:
            if error is not None:
                raise error
            return
        messages: list[Any] = [None] * self.world
        dist.all_gather_object(messages, None if error is None else str(error), self.group)
        if error is not None:
            raise error
        failed = [(r, m) for r, m in enumerate(messages) if m is not None]
        if failed:
            rank, message = failed[0]
            raise CheckpointError(f"rank {rank} failed {what}: {message}")


def attempt(fn: Any) -> BaseException | None:
    """``fn()``'s failure as a :class:`CheckpointError` (None if it succeeded)."""
    try:
        fn()
    except (OSError, CheckpointError) as exc:
        return exc if isinstance(exc, CheckpointError) else CheckpointError(str(exc))
    return None
