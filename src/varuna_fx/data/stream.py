"""``pipe.data_loader`` over an iterable dataset (a stream): global batches in the stream's
order, and a position a resumed run continues from on any layout.

A stream has no indices to permute, so its order is its own. Every replica reads the same
stream and keeps its contiguous share of each global batch (replica r of D: samples
``[r G/D, (r+1) G/D)``, as ``GlobalBatchSampler`` cuts a map-style batch), so the samples of
a step are the same whatever D is.

**The resumable position** (``state_dict()``): the samples of the stream handed to the
training loop, counted in global units as batches leave the iterator (not as they are read
ahead), with the global batch size. A dataset that follows torchdata's ``Stateful`` protocol
(``state_dict()`` / ``load_state_dict(state)`` on the dataset, as ``StatefulDataLoader``
expects) has its own state saved beside it, taken at each batch boundary, and restored on
load: the stream then continues from there itself. Any other iterable is resumed by reading
and dropping that many samples from its start (exact, as long as the stream gives the same
samples in the same order each time it is iterated; costs one read of what was consumed).

A stream that ends ends the epoch; the next ``for`` iterates it again (``forever()`` for
step-counted loops), the position counted from 0 again in the new epoch. A last global batch
the stream cannot fill is dropped, as the map-style loader drops it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch.utils.data

from ..errors import CheckpointError, InputError

FORMAT = 1
_KEYS = {"format", "kind", "epoch", "samples", "global_batch_size", "dataset_state"}


def is_stateful(dataset: Any) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and \
        callable(getattr(dataset, "load_state_dict", None))


class StreamLoader:
    """Yields this replica's collated share of one global batch of the stream per step."""

    def __init__(self, dataset: Any, *, global_batch_size: int, replica: int = 0,
                 replicas: int = 1, collate_fn: Any = None) -> None:
        if not hasattr(dataset, "__iter__"):
            raise InputError(f"{type(dataset).__name__} is not iterable: a stream for "
                             "pipe.data_loader is an iterable of samples")
        if global_batch_size % replicas:
            raise InputError(f"the global batch of {global_batch_size} samples does not divide "
                             f"into {replicas} data-parallel replicas")
        self.dataset = dataset
        self.global_batch_size, self.replica, self.replicas = \
            global_batch_size, replica, replicas
        self.collate_fn = collate_fn or torch.utils.data.default_collate
        self.epoch = 0
        self.position = 0  # samples of this epoch's stream handed out (global)
        self._dataset_state: Any = None  # the stateful dataset's state at `position`
        self._skip = 0  # samples to drop from the next iteration's start (a plain iterable)
        self._generation = 0

    def __iter__(self) -> Iterator[Any]:
        generation = self._generation
        source = iter(self.dataset)
        if self._skip:
            source = itertools.islice(source, self._skip, None)
            self._skip = 0
        share = self.global_batch_size // self.replicas
        while True:
            batch = list(itertools.islice(source, self.global_batch_size))
            if generation != self._generation:  # a state was loaded: continue from it
                yield from self.__iter__()
                return
            if len(batch) < self.global_batch_size:  # the stream ended: the epoch is done
                self.epoch, self.position, self._dataset_state = self.epoch + 1, 0, None
                self._generation += 1
                return
            self.position += self.global_batch_size
            if is_stateful(self.dataset):
                self._dataset_state = self.dataset.state_dict()
            yield self.collate_fn(batch[self.replica * share:(self.replica + 1) * share])

    def forever(self) -> Iterator[Any]:
        while True:
            yield from self

    def state_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "kind": "stream", "epoch": self.epoch,
                "samples": self.position, "global_batch_size": self.global_batch_size,
                "dataset_state": self._dataset_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (checked first: nothing changes on a bad one)."""
        if not isinstance(state, dict) or set(state) != _KEYS or state["kind"] != "stream" \
                or state["format"] != FORMAT:
            raise CheckpointError("the saved data position is not a stream's (written by "
                                  "StreamLoader.state_dict, format 1): a map-style loader's "
                                  "position cannot resume a stream")
        bad = [k for k in ("epoch", "samples", "global_batch_size")
               if type(state[k]) is not int or state[k] < 0]
        if bad:
            raise CheckpointError(f"the saved stream position has invalid {', '.join(bad)}")
        self.epoch, self.position = state["epoch"], state["samples"]
        if state["dataset_state"] is not None and is_stateful(self.dataset):
            self.dataset.load_state_dict(state["dataset_state"])
            self._dataset_state, self._skip = state["dataset_state"], 0
        else:  # a plain iterable: read past what was consumed
            self._dataset_state, self._skip = None, self.position
        self._generation += 1


def stream_loader(dataset: Any, *, replica_batch: int, replicas: int, replica: int,
                  in_place: bool, num_workers: int = 0, collate_fn: Any = None,
                  **dataloader_kwargs: Any) -> StreamLoader:
    """``pipe.data_loader`` of a stream (see ``loader_for`` for the batch): what a stream does
    not support is refused."""
    if in_place:
        raise InputError("an in-place job cannot morph a stream's position (a morph re-cuts "
                         "the step's global batch by index): give pipe.data_loader a "
                         "map-style dataset, or run without --in-place")
    if num_workers or dataloader_kwargs:
        given = ["num_workers"] * bool(num_workers) + sorted(dataloader_kwargs)
        raise InputError(f"pipe.data_loader of an iterable dataset takes no {', '.join(given)}: "
                         "the stream is read in this process (read ahead in the dataset "
                         "itself), each replica keeping its share")
    return StreamLoader(dataset, global_batch_size=replica_batch * replicas,
                        replica=replica if replicas > 1 else 0, replicas=replicas,
                        collate_fn=collate_fn)
