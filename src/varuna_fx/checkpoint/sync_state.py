"""Replica-sync state in checkpoints, per FQN like everything else (docs/API.md, "Slow links").

What a run with ``replica_sync`` other than exact needs to continue exactly
(``runtime/sync/replica_sync.py``, ``runtime/sync/diloco.py``), as DCP entries:

* PowerSGD: each replica's error feedback, ``sync/replica<r>/powersgd/error/<fqn>``; the
  warm-started ``Q`` factors (the same on every replica), ``sync/powersgd/q/<fqn>``; the steps
  reduced so far, ``sync/powersgd/steps``. The model and optimizer are the same on every
  replica (the reduced gradients are), saved as always.
* DiLoCo: ``model/<fqn>`` holds the *anchor* (the parameters the replicas last agreed on), so a
  DiLoCo checkpoint loads as a model anywhere (any layout, any setting, one process); the
  outer momentum ``sync/diloco/momentum/<fqn>`` and inner step count
  ``sync/diloco/inner_steps``; each replica's own parameters, ``sync/replica<r>/local/<fqn>``,
  and its own optimizer state: replica 0's under the usual ``optim/`` keys (what a run without
  DiLoCo loads), replica r's under ``sync/replica<r>/optim...``.

Loading (any layout): every key is per FQN, so stages may be cut anywhere. Replica r takes
saved replica r's entries where the checkpoint has them; a replica the checkpoint did not have
(more replicas now) starts from the anchor with replica 0's optimizer state and no error
feedback. A checkpoint without these entries (an exact run's) starts the sync fresh: PowerSGD
with zero error and new factors, DiLoCo with its anchor at the loaded model and no momentum.
"""

from __future__ import annotations

from typing import Any

import torch

from .checkpointable import Checkpointable
from .contents import MODEL

SYNC = "sync/"
_ERROR, _FACTOR, _STEPS = "powersgd/error/", SYNC + "powersgd/q/", SYNC + "powersgd/steps"
_LOCAL, _MOMENTUM, _INNER = "local/", SYNC + "diloco/momentum/", SYNC + "diloco/inner_steps"


class SyncState:
    """One rank's replica-sync state as checkpoint entries (None from :func:`of` where there
    is none: one process, one replica, exact)."""

    def __init__(self, grad_sync: Any, replica: int) -> None:
        self.sync, self.replica = grad_sync, replica
        self.mine = f"{SYNC}replica{replica}/"

    @property
    def diloco(self) -> Any:
        return self.sync.diloco

    # -- saving --------------------------------------------------------------------------------

    def model(self) -> dict[str, torch.Tensor]:
        """Entries replacing ``model/<fqn>``: DiLoCo's anchor for the trained parameters."""
        if self.diloco is None:
            return {}
        return {MODEL + n: a.detach() for n, a in self.diloco.anchor.items()}

    def optimizer(self, entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The optimizer's entries as this replica saves them: under DiLoCo, replica r > 0's
        under its own prefix (each replica's inner state is its own)."""
        if self.diloco is None or self.replica == 0:
            return entries
        return {self.mine + k: v for k, v in entries.items()}

    def entries(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        hook, diloco = self.sync.hook, self.diloco
        if hook is not None and hook.state is not None:
            out.update({f"{self.mine}{_ERROR}{n}": e.detach().clone()
                        for n, e in hook.errors().items()})
            out.update({_FACTOR + n: q.detach().clone() for n, q in hook.factors().items()})
            out[_STEPS] = torch.tensor([hook.steps], dtype=torch.int64)
        if diloco is not None:
            out.update({f"{self.mine}{_LOCAL}{n}": p.detach()
                        for n, p in diloco.named.items()})
            out.update({_MOMENTUM + n: m.detach() for n, m in diloco.momentum().items()})
            out[_INNER] = torch.tensor([diloco.inner_steps], dtype=torch.int64)
        return out

    # -- loading -------------------------------------------------------------------------------

    def optimizer_prefix(self, available: list[str]) -> str:
        """Where this replica's optimizer state is in a checkpoint: its own prefix where it
        has one (DiLoCo, replica r > 0), else the usual keys."""
        if self.diloco is None or self.replica == 0:
            return ""
        return self.mine if any(k.startswith(self.mine + "optim") for k in available) else ""

    def wanted(self, available: list[str]) -> list[str]:
        """The keys of this replica's sync state that the checkpoint holds."""
        names = set(self.sync.held)
        keys = []
        for k in available:
            for prefix in (f"{self.mine}{_ERROR}", _FACTOR, f"{self.mine}{_LOCAL}", _MOMENTUM):
                if k.startswith(prefix) and k[len(prefix):] in names:
                    keys.append(k)
        return keys + [k for k in (_STEPS, _INNER) if k in available]

    def restore(self, loaded: dict[str, torch.Tensor]) -> None:
        """Put the loaded state back (the model already holds ``model/``: DiLoCo's anchor)."""
        def by_name(prefix: str) -> dict[str, torch.Tensor]:
            return {k[len(prefix):]: v for k, v in loaded.items() if k.startswith(prefix)}

        hook, diloco = self.sync.hook, self.diloco
        if hook is not None and hook.state is not None:
            steps = int(loaded[_STEPS][0]) if _STEPS in loaded else 0
            hook.restore(steps, by_name(f"{self.mine}{_ERROR}"), by_name(_FACTOR),
                         self.sync.hook_buckets())
        if diloco is not None:
            inner = int(loaded[_INNER][0]) if _INNER in loaded else 0
            anchor = {n: p.detach().clone() for n, p in diloco.named.items()}
            diloco.restore(inner, anchor, by_name(_MOMENTUM))
            local = by_name(f"{self.mine}{_LOCAL}")
            with torch.no_grad():
                for n, value in local.items():
                    diloco.named[n].copy_(value)


def of(pipe: Checkpointable) -> SyncState | None:
    """The pipeline's replica-sync state, or None where it has none to save."""
    sync = pipe.runtime.grad_sync
    if sync is None or (sync.hook is None and sync.diloco is None):
        return None
    return SyncState(sync, pipe.replica_index)


def strip(prefix: str, loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``loaded`` with the optimizer's entries under ``prefix`` renamed to the usual keys."""
    if not prefix:
        return loaded
    out = dict(loaded)
    for k, v in loaded.items():
        if k.startswith(prefix):
            out[k[len(prefix):]] = v
    return out
