"""Each data-parallel replica's contiguous share of a global batch (``pipe.shard``).

With D replicas every one must step on different samples, as with DDP: passing the same global
batch to ``pipe.step`` on every replica trains on the same data D times. Nothing can detect that
cheaply (the replicas would have to compare their inputs), so ``pipe.shard`` makes the right
thing the easy one: every rank loads the same global batch and keeps its replica's slice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import torch
import torch.utils._pytree as pytree

from ..errors import InputError

T = TypeVar("T")


def shard_batch(batch: T, replica: int, replicas: int) -> T:
    """Replica ``replica`` of ``replicas``'s slice of dim 0 of every tensor in ``batch``.

    ``batch`` is a tensor or any nesting of tuples, lists and dicts (other mappings, such as
    a tokenizer's ``BatchEncoding``, come back as dicts); non-tensor leaves and 0-d tensors are
    kept whole. Replica r takes samples ``[r * n, (r + 1) * n)`` with ``n = N / replicas``.
    """
    if replicas < 1 or not 0 <= replica < replicas:
        raise InputError(f"replica {replica} of {replicas}: need 0 <= replica < replicas")
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        batch = dict(batch)  # type: ignore[assignment]
    leaves, spec = pytree.tree_flatten(batch)
    sizes = {leaf.shape[0] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim()}
    if not sizes:
        raise InputError("shard: the batch holds no tensor with a batch dimension (dim 0)")
    if len(sizes) > 1:
        raise InputError(f"shard: tensors disagree on the batch size (dim 0): {sorted(sizes)}")
    total = sizes.pop()
    if total % replicas:
        raise InputError(
            f"shard: a global batch of {total} samples does not split evenly over {replicas} "
            f"data-parallel replicas; pass a global batch that is a multiple of {replicas}")
    n = total // replicas
    out = [leaf[replica * n:(replica + 1) * n]
           if isinstance(leaf, torch.Tensor) and leaf.dim() else leaf for leaf in leaves]
    return pytree.tree_unflatten(out, spec)  # type: ignore[no-any-return]

