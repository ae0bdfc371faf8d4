"""The global sample order and one replica's share of each global batch.

The order of an epoch is a permutation of the dataset's indices drawn from ``(seed, epoch)``
alone (numpy's ``SeedSequence([seed, epoch])``, so no two (seed, epoch) pairs share a stream,
unlike ``seed + epoch``). Global batch ``k`` of an epoch is ``order[start + k*G : start +
(k+1)*G]`` for the global batch size ``G``, and replica ``r`` of ``D`` takes the contiguous
``G/D`` samples ``[r*G/D, (r+1)*G/D)`` of it, as ``pipe.shard`` cuts a batch. So one process and
any (P, D, micro-batch size) step on the same samples in the same global order; the layout
only decides who holds which part of each global batch. An epoch ends at its last full global
batch (a partial one would not divide into the replicas' micro-batches).

:class:`GlobalBatchSampler` is a torch batch sampler (``Sampler[list[int]]``): torch's
``DataLoader(batch_sampler=...)`` runs it, so workers, pinned memory and prefetching are
torch's own.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler

from ..errors import InputError


def check_count(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise InputError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class GlobalBatchSampler(Sampler[list[int]]):
    """Replica ``replica`` of ``replicas``: its index list of every global batch of the epoch
    ``self.epoch``, from sample ``self.start`` of that epoch's order on."""

    def __init__(self, size: int, global_batch_size: int, *, replica: int = 0,
                 replicas: int = 1, shuffle: bool = True, seed: int = 0) -> None:
        self.size = check_count("the dataset's length", size, 0)
        self.global_batch_size = check_count("global_batch_size", global_batch_size)
        self.replicas = check_count("replicas", replicas)
        self.replica = check_count("replica", replica, 0)
        self.seed = check_count("seed", seed, 0)
        self.shuffle = bool(shuffle)
        if self.replica >= self.replicas:
            raise InputError(f"replica {replica} of {replicas}: the index must be below "
                             "the number of replicas")
        if self.global_batch_size % self.replicas:
            raise InputError(
                f"the global batch of {self.global_batch_size} samples does not divide into "
                f"{self.replicas} data-parallel replicas: make it a multiple of {self.replicas}")
        if self.size < self.global_batch_size:
            raise InputError(
                f"the dataset holds {self.size} samples, fewer than one global batch of "
                f"{self.global_batch_size}: use more data or a smaller global_batch_size")
        self.epoch = 0
        self.start = 0  # samples of the epoch's order already consumed
        self._order: tuple[int, np.ndarray] | None = None

    @property
    def share(self) -> int:
        """Samples of each global batch one replica takes."""
        return self.global_batch_size // self.replicas

    def reorder(self, seed: int, shuffle: bool) -> None:
        """Draw the epochs' orders from ``seed`` (shuffled or not) from now on."""
        self.seed, self.shuffle = seed, shuffle
        self._order = None  # (the kept epoch's order was another seed's)

    def order(self, epoch: int) -> np.ndarray:
        """The dataset's indices in epoch ``epoch``'s order (the last epoch's is kept)."""
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
                    [self.seed, epoch])))
                order = rng.permutation(self.size)
            else:
                order = np.arange(self.size)
            self._order = (epoch, order)
        return self._order[1]

    def batches(self, start: int = 0) -> int:
        """Full global batches in an epoch from sample ``start`` of its order on."""
        return max(self.size - start, 0) // self.global_batch_size

    def global_batch(self, epoch: int, start: int) -> list[int]:
        """The global batch that begins at sample ``start`` of epoch ``epoch``'s order."""
        return self.order(epoch)[start:start + self.global_batch_size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order(self.epoch)
        lo = self.start + self.replica * self.share
        for _ in range(self.batches(self.start)):
            yield order[lo:lo + self.share].tolist()
            lo += self.global_batch_size

    def __len__(self) -> int:
        return self.batches(self.start)
