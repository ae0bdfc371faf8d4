"""``pipe.data_loader`` over an iterable dataset (issue 44 item 2): the stream's global batches,
each replica its share, and a resumable position -- a stateful dataset's own state (torchdata's
``Stateful`` protocol) or, for a plain iterable, the samples consumed -- that continues on
another layout exactly where an uninterrupted run would."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import varuna_fx as vf
from varuna_fx.data.stream import StreamLoader


class Numbers(torch.utils.data.IterableDataset):
    """0, 1, 2, ... n-1 as one-element tensors."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (torch.tensor([i]) for i in range(self.n))


class StatefulNumbers(Numbers):
    """Resumes itself from ``load_state_dict`` (iterating again continues where it was)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.next = 0
        self.iterations = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        self.iterations += 1
        while self.next < self.n:
            self.next += 1
            yield torch.tensor([self.next - 1])
        self.next = 0

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next = state["next"]


def _flat(batches: Any) -> list[int]:
    return [int(v) for b in batches for v in b.reshape(-1)]


@pytest.mark.parametrize("make", [Numbers, StatefulNumbers])
def test_a_stream_resumes_on_another_layout_where_it_stopped(make: Any) -> None:
    whole = StreamLoader(make(40), global_batch_size=8)
    first = whole.__iter__()
    got = [next(first) for _ in range(3)]
    assert _flat(got) == list(range(24))
    state = whole.state_dict()
    assert state["samples"] == 24
    # two replicas after the restart: each its half of the next global batch
    halves = []
    for replica in (0, 1):
        loader = StreamLoader(make(40), global_batch_size=8, replica=replica, replicas=2)
        loader.load_state_dict(state)
        halves.append(_flat([next(iter(loader))]))
    assert halves == [[24, 25, 26, 27], [28, 29, 30, 31]]


def test_the_stream_ending_ends_the_epoch_and_a_short_batch_is_dropped() -> None:
    loader = StreamLoader(Numbers(20), global_batch_size=8)
    assert _flat(loader) == list(range(16))
    assert (loader.epoch, loader.position) == (1, 0)


def test_pipe_data_loader_takes_a_stream_and_refuses_what_it_cannot_do() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(1, 2))
    pipe = vf.compile(model, example_inputs=(torch.randn(4, 1),), stages=1,
                      loss_fn=lambda out, _: out.sum())
    loader = pipe.data_loader(Numbers(12))
    assert isinstance(loader, StreamLoader) and loader.global_batch_size == 4
    with pytest.raises(vf.InputError, match="takes no num_workers"):
        pipe.data_loader(Numbers(12), num_workers=2)
    with pytest.raises(vf.CheckpointError, match="not a stream's"):
        loader.load_state_dict({"epoch": 0, "samples": 4})
