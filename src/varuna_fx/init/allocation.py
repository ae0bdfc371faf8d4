"""A one-process pipeline's tensors of a ``vf.deferred_init`` model, allocated at first use.

``vf.compile`` of a deferred model allocates nothing by itself: planning a 70B Llama for 64 GPUs
in one process costs what planning costs (it once materialised the whole model in
``make_pipeline``: a 7B grew the process to 17.7 GB). The pipeline keeps a
:class:`DeferredAllocation` instead and calls :meth:`DeferredAllocation.allocate` the first time
it needs real tensors (a step, a forward, ``parameters()``, ``state_dict()``, a load, an
optimizer). Before allocating it compares the bytes the model's meta storages need with what
this process can still allocate on the device (``world/memory.py``) and refuses with both
numbers (:class:`AllocationError`) when they do not fit. ``vf.compile`` already checked that
every tensor can be replayed (``materialize.check_replayable``), so a model that could never be
allocated is refused there, not at its first step.

A distributed rank allocates its own stage's tensors while its runtime is made (every rank
broadcasts replica 0's weights then): ``runtime/distributed.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..costs.memory import format_bytes
from ..errors import AllocationError
from ..world.memory import available_memory
from .materialize import (
    deferred_bytes,
    materialize_tensors,
    replace_tensors,
    retarget_devices,
    successor,
)


class DeferredAllocation:
    """What a one-process pipeline allocates when first used: every meta tensor of ``model``
    that ``vf.deferred_init`` recorded, on ``device``, replaced in the model and in ``roots``
    (the captured graph, the stage modules). ``ranks``: the plan's world size, for the advice
    a refusal gives."""

    def __init__(self, model: nn.Module, roots: Sequence[nn.Module], device: torch.device,
                 ranks: int) -> None:
        self.model, self.roots, self.device, self.ranks = model, list(roots), device, ranks
        # the meta tensors the stages hold now: another pipeline of the same model may
        # materialise them first (successor)
        self.held = [t for t in [*model.parameters(), *model.buffers()] if t.is_meta]

    def needed(self) -> int:
        """Bytes allocating would take now (0 once another pipeline allocated the model)."""
        return deferred_bytes(self.model)

    def allocate(self) -> None:
        """Allocate and initialise, or raise :class:`AllocationError` when it cannot fit."""
        need = self.needed()
        room = available_memory(self.device) if need else None
        if room is not None and need > room[0]:
            free, source = room
            raise AllocationError(
                f"this process would allocate {format_bytes(need)} ({need:,} bytes) for the "
                f"parameters and buffers of {type(self.model).__name__} on {self.device} (a "
                "pipeline in one process holds every stage), but it can allocate "
                f"{format_bytes(free)} ({free:,} bytes) ({source}). Nothing was allocated. "
                f"Run it distributed on the plan's {self.ranks} ranks (varuna-fx run / "
                "torchrun: each rank allocates only its stage's tensors), or on a machine "
                "with more memory; planning (pipe.plan, pipe.stages' code) allocates nothing",
                needed=need, available=free)
        materialize_tensors(self.model, None, self.device, roots=self.roots)
        made = {id(t): new for t in self.held if (new := successor(t)) is not None}
        replace_tensors(self.roots, made)  # what another pipeline of this model allocated
        retarget_devices(self.roots, self.device)
