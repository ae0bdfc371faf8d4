"""Collective checks on the checkpoint process group: every rank learns whether any failed.

A bad argument may show on one rank only (``extra`` is rank 0's, the destination directory is
prepared by rank 0): every rank must learn of it before a collective save or load, or the
others would wait for that rank in vain.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from ..errors import CheckpointError, PeerTimeoutError


class Agreement:
    """The ranks of one checkpoint process group (``group`` None: one process)."""

    def __init__(self, group: Any, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world

    def agree(self, error: BaseException | None, what: str, value: Any = None) -> list[Any]:
        """A barrier that also tells every rank whether any rank failed (and raises there);
        returns every rank's ``value``, by rank."""
        if self.group is None:
            if error is not None:
                raise error
            return [value]
        gathered: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(gathered, (None if error is None else str(error), value),
                                   self.group)
        except RuntimeError as exc:  # a peer vanished (gloo/NCCL raise RuntimeError kinds)
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise PeerTimeoutError(
                f"rank {self.rank} lost a peer while the ranks agreed on {what}: a process "
                f"crashed or was killed ({detail})") from exc
        if error is not None:
            raise error
        failed = [(r, m) for r, (m, _) in enumerate(gathered) if m is not None]
        if failed:
            rank, message = failed[0]
            raise CheckpointError(f"rank {rank} failed {what}: {message}")
        return [v for _, v in gathered]

    def same_call(self, call: str, path: str, optimizer: str | None,
                  holds_parameters: bool) -> None:
        """Every rank passed the same path (as given or resolved) and, where it holds
        parameters, the same optimizer class: else every rank raises, naming them. One rank
        saving elsewhere (a timestamp in the name) would leave a checkpoint marked complete
        without that rank's shard; a rank loading elsewhere would train on another step."""
        mine = (path, os.path.abspath(path), optimizer, holds_parameters)
        calls = self.agree(None, call, mine)
        paths = {p for p, _, _, _ in calls}
        if len(paths) > 1 and len({a for _, a, _, _ in calls}) > 1:
            shown = "; ".join(f"rank {r}: {p}" for r, (p, _, _, _) in enumerate(calls))
            raise CheckpointError(
                f"the ranks passed different paths to {call} ({shown}): every rank must pass "
                "the same path (compute it from values every rank shares, such as the step, "
                "not from a clock or the rank)")
        kinds = {o for _, _, o, held in calls if held}
        if len(kinds) > 1:
            shown = "; ".join(f"rank {r}: {o}" for r, (_, _, o, held) in enumerate(calls)
                              if held)
            raise CheckpointError(
                f"the ranks passed different optimizers to {call} ({shown}): pass the "
                "optimizer on every rank (or on none), of one class")
