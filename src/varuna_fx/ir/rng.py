"""Dropout masks that depend on (step seed, operation, micro-batch) only.

Before every random operation a stage's generated code calls ``seed_node("<node name>")``. While
a worker runs a micro-batch (``rng_context``), that reseeds the generators from the step's seed,
the node's name and the micro-batch index; outside a worker it does nothing, so a stage module
called by hand draws from the global generator like any module. Consequences: a recompute
replays exactly the masks of its forward, and the masks do not depend on how the model was
partitioned, on the schedule or on recomputation -- only on the data and the seed.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.fx

_context = threading.local()
_MASK = 2**63 - 1


@contextmanager
def rng_context(seed: int, micro_batch: int) -> Iterator[None]:
    """Seed random nodes from (seed, node, micro_batch); the global RNG state is restored."""
    cuda = torch.cuda.is_available()
    devices = [torch.cuda.current_device()] if cuda else []
    with torch.random.fork_rng(devices=devices):
        _context.key = (seed, micro_batch, cuda)
        try:
            yield
        finally:
            _context.key = None


@torch.fx.wrap
def seed_node(name: str) -> None:
    key = getattr(_context, "key", None)
    if key is None:
        return
    seed, micro_batch, cuda = key
    value = (seed * 1_000_003 + zlib.crc32(name.encode()) * 1_009 + micro_batch) & _MASK
    # not torch.manual_seed: it also seeds every lazy device backend (0.1-0.5 ms on CPU)
    torch.default_generator.manual_seed(value)
    if cuda:
        torch.cuda.manual_seed(value)
