"""The step's samples on a new layout: each new replica takes its share of the same global batch.

A morph runs at the start of a step (a notice or a join: every old replica is alive and holds
its share of the step's global batch) or inside one (a process vanished mid-step). Either way
the step runs on the new layout with the same global batch, cut for the new D. The step's
arguments are seen as pytree leaves; every tensor whose dim 0 is the batch is a *sample* tensor,
whose rows ``[r n, (r+1) n)`` replica r of D holds. Rows move like any other state
(``state.py``'s ``("@in", k)`` items): the new share comes from whichever old replica held it.
A share nobody alive holds (a whole replica vanished) is cut again from the data it came from:
a loader registered with the pipeline (``pipe.data_loader``, or ``pipe.track``) that handed out
those very tensors re-reads the global batch and cuts the new share (:class:`MorphableData`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
import torch.utils._pytree as pytree

from ..errors import VarunaFxError
from .state import INPUT, Descriptor, Sources, input_holdings
from .transfer import Range, assemble

Args = tuple[tuple[Any, ...], dict[str, Any], Any]  # (positional inputs, keyword inputs, target)


@runtime_checkable
class MorphableData(Protocol):
    """A data loader an in-place morph can move: it knows the global batch it handed out last
    and cuts any share of it, and positions later batches for another replica and D."""

    last_batch: Any  # what it handed out last (this replica's share, as collated)

    def last_share(self, replica: int, replicas: int) -> Any: ...

    def reshard(self, replica: int, replicas: int) -> None: ...

    def state_at_last(self) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def sample_tensors(args: Args) -> tuple[list[Any], Any, list[int], int]:
    """(leaves, spec, indices of the sample tensors, rows per replica)."""
    leaves, spec = pytree.tree_flatten(args)
    found = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.dim() > 0]
    rows = leaves[found[0]].shape[0] if found else 0
    found = [i for i in found if leaves[i].shape[0] == rows]
    return leaves, spec, found, rows


def input_state(args: Args, replica: int, replicas: int, desc: Descriptor,
                sources: Sources) -> None:
    _, _, found, _ = sample_tensors(args)
    leaves = pytree.tree_leaves(args)
    input_holdings([leaves[i] for i in found], replica, replicas, desc, sources)


def input_needs(args: Args, old_replicas: int, replica: int, replicas: int,
                desc: Descriptor) -> None:
    """This rank's rows on the new layout (``replicas`` = D')."""
    leaves, _, found, rows = sample_tensors(args)
    total = rows * old_replicas
    if total % replicas:
        raise VarunaFxError(f"the global batch of {total} samples does not divide into the new "
                            f"{replicas} replicas")
    share = total // replicas
    for k, i in enumerate(found):
        row = leaves[i][0].numel()
        desc.needs_input[str(k)] = [(replica * share * row, share * row)]


def rebuilt(args: Args, pieces: Sources, needs: dict[str, list[Range]]) -> Args:
    """The step's arguments with every sample tensor's rows replaced by the new share."""
    leaves, spec, found, _ = sample_tensors(args)
    out = list(leaves)
    for k, i in enumerate(found):
        t = leaves[i]
        (start, count), = needs[str(k)]
        flat = assemble(pieces[(INPUT, str(k))], start, count, t.dtype)
        out[i] = flat.view(-1, *t.shape[1:])
    return pytree.tree_unflatten(out, spec)


def from_loader(args: Args, loaders: list[Any], replica: int, replicas: int) -> Args:
    """The new share cut again by the loader that handed out these tensors, else an error."""
    leaves, spec, found, _ = sample_tensors(args)
    for loader in loaders:
        last = pytree.tree_leaves(getattr(loader, "last_batch", None))
        where = {id(x): j for j, x in enumerate(last)}
        if all(id(leaves[i]) in where for i in found):
            fresh = pytree.tree_leaves(loader.last_share(replica, replicas))
            out = list(leaves)
            for i in found:
                out[i] = fresh[where[id(leaves[i])]]
            return pytree.tree_unflatten(out, spec)
    raise VarunaFxError(
        "a process holding a share of this step's batch vanished and no registered data loader "
        "handed out these tensors, so this step's global batch cannot be cut for the new layout: "
        "pass pipe.step the tensors pipe.data_loader yields (or a loader registered with "
        "pipe.track that implements varuna_fx.morph.batch.MorphableData)")
