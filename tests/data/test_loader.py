"""pipe.data_loader's loader: the global sample order depends on (seed, epoch) only, each
replica takes its contiguous share, and the position (in global units) resumes on any D.

The loader is a pure function of (dataset, global batch, replica, replicas, seed, position),
so D replicas are simulated here by D loaders in one process; tests/data/test_data_on_ranks.py
runs it on gloo ranks through real pipelines."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch

from varuna_fx import CheckpointError, InputError
from varuna_fx.data.loader import GlobalBatchLoader
from varuna_fx.data.sampler import GlobalBatchSampler

SIZE, GLOBAL = 61, 12  # 5 full global batches per epoch, one sample left over


def loaders(replicas: int, seed: int = 0, **kw: object) -> list[GlobalBatchLoader]:
    data = list(range(SIZE))  # a plain list is a map-style dataset: sample i is i
    return [GlobalBatchLoader(data, global_batch_size=GLOBAL, replica=r, replicas=replicas,
                              seed=seed, **kw) for r in range(replicas)]


def global_batches(group: list[GlobalBatchLoader], steps: int) -> list[list[int]]:
    """Each step's global batch: the replicas' shares, replica 0 first."""
    streams = [_forever(loader) for loader in group]
    out = []
    for _ in range(steps):
        shares = [next(s) for s in streams]
        assert all(len(share) == GLOBAL // len(group) for share in shares)
        out.append([int(i) for share in shares for i in share])
    return out


def _forever(loader: GlobalBatchLoader) -> Iterator[torch.Tensor]:
    while True:
        yield from loader


def test_every_layout_sees_the_same_global_batches_in_the_same_order() -> None:
    reference = global_batches(loaders(1), 12)  # over two epochs and a bit
    assert len(reference[0]) == GLOBAL
    for d in (2, 3, 4):
        assert global_batches(loaders(d), 12) == reference
    epoch0, epoch1 = reference[:5], reference[5:10]
    assert len({i for b in epoch0 for i in b}) == 5 * GLOBAL  # no sample twice in an epoch
    assert epoch0 != epoch1  # each epoch its own order
    assert global_batches(loaders(1, seed=1), 5) != epoch0
    unshuffled = global_batches(loaders(2, shuffle=False), 5)
    assert unshuffled[0] == list(range(GLOBAL))


def test_the_order_is_a_function_of_seed_and_epoch_only() -> None:
    a = GlobalBatchSampler(SIZE, GLOBAL, seed=3)
    b = GlobalBatchSampler(SIZE, 6, replica=1, replicas=2, seed=3)
    assert a.order(4).tolist() == b.order(4).tolist()
    # SeedSequence([seed, epoch]): (seed 0, epoch 1) is not (seed 1, epoch 0)
    assert GlobalBatchSampler(SIZE, GLOBAL, seed=0).order(1).tolist() != \
        GlobalBatchSampler(SIZE, GLOBAL, seed=1).order(0).tolist()


@pytest.mark.parametrize("then", [1, 3])
def test_a_position_saved_on_two_replicas_resumes_on_one_or_three(then: int) -> None:
    reference = global_batches(loaders(1), 9)
    before = loaders(2)
    assert global_batches(before, 4) == reference[:4]
    states = [loader.state_dict() for loader in before]
    assert states[0] == states[1]  # global units: no replica in the state
    assert states[0]["global_batches"] == 4 and states[0]["epoch"] == 0
    after = loaders(then, seed=0)
    for loader in after:
        loader.load_state_dict(states[0])
    assert global_batches(after, 5) == reference[4:9]  # across the epoch's end too


def test_prefetched_batches_do_not_move_the_position() -> None:
    loader = loaders(1)[0]
    it = iter(loader)
    first = next(it)
    assert loader.state_dict()["samples"] == GLOBAL
    assert loader.last_global_batch() == first.tolist()
    nxt = loader.next_global_batch()
    assert next(it).tolist() == nxt


def test_the_position_across_the_end_of_an_epoch() -> None:
    loader = loaders(1)[0]
    batches = list(loader)
    assert len(batches) == len(loader) == SIZE // GLOBAL
    assert loader.epoch == 1 and loader.position == 0  # the next `for` runs epoch 1
    second = list(loader)
    assert len(second) == 5 and second[0].tolist() != batches[0].tolist()
    # saved after the last batch but before the loop ended: counted as the next epoch
    loader = loaders(1)[0]
    it = iter(loader)
    for _ in range(5):
        next(it)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["samples"] == 0


def test_loading_during_an_iteration_restarts_it_at_the_loaded_position() -> None:
    reference = global_batches(loaders(1), 4)
    loader = loaders(1)[0]
    it = iter(loader)
    next(it), next(it), next(it)
    state = loaders(1)[0].state_dict()  # position 0
    loader.load_state_dict(state)
    assert next(it).tolist() == reference[0]


def test_a_new_global_batch_size_continues_at_the_same_sample() -> None:
    data = list(range(SIZE))
    old = GlobalBatchLoader(data, global_batch_size=GLOBAL, seed=0)
    next(iter(old))
    order = old.sampler.order(0).tolist()
    new = GlobalBatchLoader(data, global_batch_size=8, replica=1, replicas=2, seed=0)
    with pytest.warns(UserWarning, match="continues at sample 12"):
        new.load_state_dict(old.state_dict())
    assert next(iter(new)).tolist() == order[12 + 4:12 + 8]  # replica 1's half


def test_the_saved_seed_wins_with_a_warning() -> None:
    a = loaders(1, seed=5)[0]
    next(iter(a))
    b = loaders(1, seed=0)[0]
    with pytest.warns(UserWarning, match="seed 5"):
        b.load_state_dict(a.state_dict())
    assert b.next_global_batch() == a.next_global_batch()


def test_a_dataset_with_dict_samples_collates_as_torch_does() -> None:
    class Rows:  # what an HF datasets Dataset looks like to the loader: map-style, dict rows
        def __len__(self) -> int:
            return 20

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": torch.full((3,), i), "labels": torch.tensor(i)}

    batch = next(iter(GlobalBatchLoader(Rows(), global_batch_size=4, shuffle=False)))
    assert batch["input_ids"].shape == (4, 3) and batch["labels"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("make, match", [
    (lambda: GlobalBatchLoader(list(range(5)), global_batch_size=8), "fewer than one global"),
    (lambda: GlobalBatchLoader(list(range(50)), global_batch_size=8, replicas=3),
     "does not divide into 3"),
    (lambda: GlobalBatchLoader(list(range(50)), global_batch_size=8, replica=2, replicas=2),
     "below the number of replicas"),
    (lambda: GlobalBatchLoader(list(range(50)), global_batch_size=8, batch_size=4),
     "decides batch_size"),
    (lambda: GlobalBatchLoader(list(range(50)), global_batch_size=8, seed=-1), "seed"),
    (lambda: GlobalBatchLoader(list(range(50)), global_batch_size=0), "global_batch_size"),
    (lambda: GlobalBatchLoader(iter(range(50)), global_batch_size=8), "map-style"),
])
def test_refusals(make: object, match: str) -> None:
    with pytest.raises(InputError, match=match):
        make()  # type: ignore[operator]


def test_an_iterable_dataset_is_refused() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self) -> Iterator[int]:
            yield from range(10)

        def __len__(self) -> int:
            return 10

    with pytest.raises(InputError, match="map-style"):
        GlobalBatchLoader(Stream(), global_batch_size=2)


@pytest.mark.parametrize("edit, match", [
    (lambda s: s.pop("seed"), "malformed"),
    (lambda s: s.update(epoch=-1), "invalid epoch"),
    (lambda s: s.update(samples=5), "invalid samples"),
    (lambda s: s.update(shuffle=1), "invalid shuffle"),
    (lambda s: s.update(format=9), "format 9"),
    (lambda s: s.update(dataset_size=60, samples=0, global_batches=0), "61"),
])
def test_a_bad_saved_position_is_refused_and_changes_nothing(edit: object, match: str) -> None:
    loader = loaders(1)[0]
    next(iter(loader))
    state = loader.state_dict()
    edit(state)  # type: ignore[operator]
    before = loader.state_dict()
    with pytest.raises(CheckpointError, match=match), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader.load_state_dict(state)
    assert loader.state_dict() == before


@pytest.mark.slow
def test_workers_prefetch_without_moving_the_position() -> None:
    reference = global_batches(loaders(1), 5)
    loader = loaders(1, num_workers=2, prefetch_factor=2, persistent_workers=True)[0]
    it = iter(loader)
    assert next(it).tolist() == reference[0]
    state = loader.state_dict()  # workers hold batches 1..4 by now
    assert state["global_batches"] == 1
    resumed = loaders(1)[0]
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == reference[1:5]
    assert [b.tolist() for b in it] == reference[1:5]


def test_a_position_resumed_at_another_global_batch_saves_and_resumes_again() -> None:
    """Saved at 8 per step, resumed at 16 (sample 24: not a multiple of 16), one step taken:
    the loader's own state (sample 40) loads again, at 16 or back at 8, and continues at the
    sample an uninterrupted order gives (issue 42, item 6: it was refused as invalid)."""
    data = list(range(200))
    old = GlobalBatchLoader(data, global_batch_size=8, seed=0)
    batches = iter(old)
    for _ in range(3):
        next(batches)
    order = old.sampler.order(0).tolist()
    new = GlobalBatchLoader(data, global_batch_size=16, seed=0)
    with pytest.warns(UserWarning, match="continues at sample 24"):
        new.load_state_dict(old.state_dict())
    assert next(iter(new)).tolist() == order[24:40]
    for size in (16, 8, 12):
        again = GlobalBatchLoader(data, global_batch_size=size, seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            again.load_state_dict(new.state_dict())
        assert next(iter(again)).tolist() == order[40:40 + size]
        assert again.state_dict()["samples"] == 40 + size
