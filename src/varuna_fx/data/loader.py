"""``pipe.data_loader``: this replica's share of every global batch, and a position that any
layout can resume.

:class:`GlobalBatchLoader` wraps one torch ``DataLoader`` over a :class:`GlobalBatchSampler`
(``sampler.py``), so ``num_workers``, ``pin_memory``, ``prefetch_factor``,
``persistent_workers`` and ``collate_fn`` behave as in torch. Its position is counted in
*global* units -- the epoch and the samples of that epoch's order already handed to the
training loop -- as batches leave the iterator, not as workers prefetch them: prefetched but
unused batches never advance it. ``state_dict()`` holds that position with the seed and the
dataset's size; ``pipe.save_checkpoint(..., data=loader)`` stores it and
``load_checkpoint(..., data=loader)`` restores it on any (P, D, micro-batch size): the next
global batch is the one an uninterrupted run would see next, each replica taking its share.
With another global batch size than when saved, the loader continues from the same sample of
the epoch's order (the batches are then cut at the new size).

Why not torchdata's ``StatefulDataLoader``: over a map-style dataset and a sampler that is a
pure function of (seed, epoch, position), the position is the whole state; its per-worker
snapshots would add state that depends on the layout, which a change of D cannot carry.

Iterating gives the rest of the current epoch; the next ``for`` starts the next epoch
(:meth:`forever` runs epoch after epoch, for step-counted training).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch.utils.data

from ..errors import CheckpointError, InputError
from .sampler import GlobalBatchSampler

FORMAT = 1
# what the sampler decides: passing these to pipe.data_loader is refused
_OWNED = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


class GlobalBatchLoader:
    """Yields this replica's collated share of one global batch per step."""

    def __init__(self, dataset: Any, *, global_batch_size: int, replica: int = 0,
                 replicas: int = 1, shuffle: bool = True, seed: int = 0, num_workers: int = 0,
                 collate_fn: Any = None, **dataloader_kwargs: Any) -> None:
        owned = [k for k in _OWNED if k in dataloader_kwargs]
        if owned:
            raise InputError(
                f"pipe.data_loader decides {', '.join(owned)} itself (each step is one global "
                "batch of the pipeline's global_batch_size, in the order of (seed, epoch)): "
                "drop the argument; pass shuffle= and seed= to choose the order")
        if isinstance(dataset, torch.utils.data.IterableDataset) or \
                not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise InputError(
                f"pipe.data_loader needs a map-style dataset (with __len__ and __getitem__), "
                f"got {type(dataset).__name__}: the global order is a permutation of indices, "
                "which a stream does not have. Materialise it, or index it (an HF datasets "
                "Dataset is map-style; an IterableDataset is not)")
        self.dataset = dataset
        self.sampler = GlobalBatchSampler(len(dataset), global_batch_size, replica=replica,
                                          replicas=replicas, shuffle=shuffle, seed=seed)
        self.loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=self.sampler, num_workers=num_workers,
            collate_fn=collate_fn, **dataloader_kwargs)
        self.epoch = 0
        # samples of this epoch's order handed out: a multiple of the batch, unless a state
        # saved at another global batch size was loaded (then a multiple plus its offset)
        self.position = 0
        self._generation = 0  # bumped by load_state_dict: live iterators restart from there
        self.last_batch: Any = None  # what the last step got (an in-place morph cuts it again)

    @property
    def global_batch_size(self) -> int:
        return self.sampler.global_batch_size

    def __len__(self) -> int:
        """Global batches (steps) in one epoch."""
        return self.sampler.batches()

    def __iter__(self) -> Iterator[Any]:
        return _Iteration(self)

    def forever(self) -> Iterator[Any]:
        """Epoch after epoch without end (for loops counted in steps)."""
        while True:
            yield from self

    def last_global_batch(self) -> list[int]:
        """The dataset indices of the global batch handed out last, in global order (every
        replica's share, replica 0 first); [] before the first."""
        if self.position == 0:
            return []
        return self.sampler.global_batch(self.epoch, self.position - self.global_batch_size)

    # -- in-place morphing (varuna_fx.morph.batch.MorphableData) ------------------------------

    def last_share(self, replica: int, replicas: int) -> Any:
        """Replica ``replica`` of ``replicas``'s share of the global batch handed out last,
        collated as this loader collates (a morph re-cuts a step whose share vanished)."""
        indices = self.last_global_batch()
        share = len(indices) // replicas
        picked = indices[replica * share:(replica + 1) * share]
        return self.loader.collate_fn([self.dataset[i] for i in picked])

    def reshard(self, replica: int, replicas: int) -> None:
        """From the next batch on, hand out replica ``replica`` of ``replicas``'s share (the
        same global order and position)."""
        if self.global_batch_size % replicas:
            raise InputError(f"the global batch of {self.global_batch_size} samples does not "
                             f"divide into {replicas} data-parallel replicas")
        self.sampler.replica, self.sampler.replicas = replica, replicas
        self._generation += 1

    def state_at_last(self) -> dict[str, Any]:
        """A state from which the next batch handed out is the one handed out last (what a
        process joining mid-run starts from: the step it runs first)."""
        state = self.state_dict()
        if self.position:
            at = self.position - self.global_batch_size
            state.update(epoch=self.epoch, samples=at, global_batches=at // self.global_batch_size)
        return state

    def next_global_batch(self) -> list[int]:
        """The dataset indices of the global batch the next step will get."""
        epoch, position = self._normalised()
        return self.sampler.global_batch(epoch, position)

    # -- the position --------------------------------------------------------------------------

    def _normalised(self) -> tuple[int, int]:
        """(epoch, position) with an exhausted epoch counted as the next one's start."""
        if self.position + self.global_batch_size > self.sampler.size:
            return self.epoch + 1, 0
        return self.epoch, self.position

    def state_dict(self) -> dict[str, Any]:
        """The position in global units (plain data: what a checkpoint stores)."""
        epoch, position = self._normalised()
        return {"format": FORMAT, "seed": self.sampler.seed, "shuffle": self.sampler.shuffle,
                "epoch": epoch, "samples": position,
                "global_batches": position // self.global_batch_size,
                "global_batch_size": self.global_batch_size,
                "dataset_size": self.sampler.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (checked first: nothing changes on a bad one)."""
        state = check_state(state)
        if state["dataset_size"] != self.sampler.size:
            raise CheckpointError(
                f"the data position was saved over a dataset of {state['dataset_size']} "
                f"samples, but this one holds {self.sampler.size}: a position in another "
                "dataset names other samples. Load the checkpoint without data= to start this "
                "data from its beginning, or pass the dataset the run was saved with")
        changed = [f"{k} {state[k]!r} (was {getattr(self.sampler, k)!r} here)"
                   for k in ("seed", "shuffle") if state[k] != getattr(self.sampler, k)]
        if changed:
            warnings.warn(f"the data loader continues the saved run's order: {', '.join(changed)}",
                          stacklevel=3)
        if state["global_batch_size"] != self.global_batch_size:
            warnings.warn(
                f"the global batch is {self.global_batch_size} samples now, "
                f"{state['global_batch_size']} when saved: training continues at sample "
                f"{state['samples']} of epoch {state['epoch']}'s order, in batches of "
                f"{self.global_batch_size} (pass compile the same global_batch_size on every "
                "layout to keep the batches themselves)", stacklevel=3)
        self.sampler.reorder(state["seed"], state["shuffle"])
        self.epoch, self.position = state["epoch"], state["samples"]
        self._generation += 1

    def _epoch_done(self) -> None:
        """The iterator ran out of the epoch's batches: the next iteration begins the next."""
        self.epoch, self.position = self.epoch + 1, 0
        self._generation += 1


def check_state(state: Any) -> dict[str, Any]:
    """A loader state read from disk: the keys, types and ranges it must have, else
    :class:`CheckpointError` (a damaged or hand-made checkpoint must not set a nonsense
    position)."""
    ints = ("seed", "epoch", "samples", "global_batches", "global_batch_size", "dataset_size")
    if not isinstance(state, dict) or set(state) != {"format", "shuffle", *ints}:
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"the saved data position is malformed (got {keys}): it was not "
                              "written by GlobalBatchLoader.state_dict")
    if state["format"] != FORMAT:
        raise CheckpointError(f"the saved data position has format {state['format']!r}; this "
                              f"varuna_fx reads format {FORMAT}")
    bad = [k for k in ints if type(state[k]) is not int or state[k] < 0]
    if type(state["shuffle"]) is not bool:
        bad.append("shuffle")
    # global_batches counts whole batches of the saved size: a run resumed at another global
    # batch size continues mid-way through the old batches' grid (sample 24 in batches of 16),
    # so samples need not be a multiple of it -- only consistent with the count
    if not bad and (state["global_batch_size"] == 0 or
                    state["global_batches"] != state["samples"] // state["global_batch_size"] or
                    state["samples"] > state["dataset_size"]):
        bad.append("samples")
    if bad:
        raise CheckpointError(f"the saved data position has invalid {', '.join(bad)}: "
                              f"{ {k: state[k] for k in bad} }")
    return state


class _Iteration:
    """One pass over the rest of the current epoch. The loader's position moves as batches
    leave here; after a ``load_state_dict`` the pass restarts from the loaded position."""

    def __init__(self, loader: GlobalBatchLoader) -> None:
        self.loader = loader
        self._open()

    def _open(self) -> None:
        loader = self.loader
        loader.epoch, loader.position = loader._normalised()
        loader.sampler.epoch, loader.sampler.start = loader.epoch, loader.position
        self.generation = loader._generation
        self.inner = iter(loader.loader)

    def __iter__(self) -> _Iteration:
        return self

    def __next__(self) -> Any:
        loader = self.loader
        if self.generation != loader._generation:
            self._open()
        try:
            batch = next(self.inner)
        except StopIteration:
            if self.generation == loader._generation:  # the epoch is done: the next begins
                loader._epoch_done()
            raise
        loader.position += loader.global_batch_size
        loader.last_batch = batch
        return batch


def loader_for(dataset: Any, *, replica_batch: int, replicas: int, replica: int,
               **options: Any) -> GlobalBatchLoader:
    """``pipe.data_loader``: the global batch is what one step takes on every replica that runs
    (``replica_batch`` each: compile's ``global_batch_size`` / D, or the example batch; one
    process, ``replicas`` 1, steps on all of it), and this process takes replica ``replica``'s
    share."""
    return GlobalBatchLoader(dataset, global_batch_size=replica_batch * replicas,
                             replica=replica if replicas > 1 else 0, replicas=replicas,
                             **options)
