"""data=, scheduler= and stateful= in checkpoints (one process): the resumed run continues on
the samples, learning rates and state of the uninterrupted one; what cannot be saved safely,
or does not fit, is refused."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import varuna_fx as vf
from varuna_fx import CheckpointError
from varuna_fx.checkpoint import stateful
from varuna_fx.examples import GPT, GPTConfig, lm_loss

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
TOKENS = torch.randint(0, 64, (2000,), generator=torch.Generator().manual_seed(0))
SPLIT, STEPS = 3, 6


class Counter:
    """Any object with state_dict/load_state_dict (an EMA of a scalar, a step count)."""

    def __init__(self) -> None:
        self.seen, self.mean = 0, torch.zeros(())

    def update(self, loss: torch.Tensor) -> None:
        self.seen += 1
        self.mean = self.mean * 0.9 + loss.detach() * 0.1

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "mean": self.mean.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen, self.mean = state["seen"], state["mean"]


def job(seed: int = 0) -> tuple[vf.Pipeline, Any, Any, Any, Counter]:
    torch.manual_seed(seed)
    pipe = vf.compile(GPT(CONFIG), vf.Cluster(gpus=2, device="cpu"),
                      (torch.zeros(4, 8, dtype=torch.long),), loss_fn=lm_loss, stages=2,
                      micro_batch_size=2, schedule="1f1b")
    loader = pipe.data_loader(vf.TokenDataset(TOKENS, 8), seed=7)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return pipe, loader, opt, sched, Counter()


def train(pipe: vf.Pipeline, loader: Any, opt: Any, sched: Any, counter: Counter,
          steps: int) -> list[tuple[float, float, list[int]]]:
    out = []
    for _, (x, y) in zip(range(steps), loader.forever()):
        pipe.zero_grad()
        loss = pipe.step(x, target=y)
        opt.step()
        sched.step()
        counter.update(loss)
        out.append((float(loss), sched.get_last_lr()[0], loader.last_global_batch()))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list, Counter]:
    pipe, loader, opt, sched, counter = job()
    first = train(pipe, loader, opt, sched, counter, SPLIT)
    path = tmp_path_factory.mktemp("ckpt") / "step3"
    pipe.save_checkpoint(path, opt, extra={"note": "kept"}, data=loader, scheduler=sched,
                         stateful={"counter": counter})
    rest = train(pipe, loader, opt, sched, counter, STEPS - SPLIT)
    return path, first + rest, counter


def test_resume_continues_on_the_same_samples_rates_and_state(saved: Any) -> None:
    path, uninterrupted, counter = saved
    pipe, loader, opt, sched, fresh = job(seed=1)  # other weights: the load overwrites them
    extra = pipe.load_checkpoint(path, opt, data=loader, scheduler=sched,
                                 stateful={"counter": fresh})
    assert extra == {"note": "kept"}
    assert loader.state_dict()["global_batches"] == SPLIT and sched.last_epoch == SPLIT
    assert fresh.seen == SPLIT
    resumed = train(pipe, loader, opt, sched, fresh, STEPS - SPLIT)
    assert [r[2] for r in resumed] == [r[2] for r in uninterrupted[SPLIT:]]  # the samples
    assert [r[1] for r in resumed] == [r[1] for r in uninterrupted[SPLIT:]]  # the rates
    torch.testing.assert_close(torch.tensor([r[0] for r in resumed]),
                               torch.tensor([r[0] for r in uninterrupted[SPLIT:]]))
    torch.testing.assert_close(fresh.mean, counter.mean)


@pytest.fixture(scope="module")
def other() -> tuple[vf.Pipeline, Any, Any, Any, Counter]:
    """A second job the tests below share (they only load into it or are refused)."""
    return job()


def test_a_state_saved_but_not_asked_for_is_named(saved: Any, other: Any) -> None:
    path, _, _ = saved
    pipe, _, opt, _, _ = other
    loader = pipe.data_loader(vf.TokenDataset(TOKENS, 8), seed=7)
    with pytest.warns(UserWarning, match=r"data=, scheduler=, stateful\['counter'\]"):
        pipe.load_checkpoint(path, opt)
    assert loader.state_dict()["samples"] == 0


def test_a_state_asked_for_but_not_saved_is_refused(other: Any, tmp_path: Path) -> None:
    pipe, loader, opt, _, _ = other
    pipe.save_checkpoint(tmp_path / "bare", opt)
    with pytest.raises(CheckpointError, match="holds no saved state for data="):
        pipe.load_checkpoint(tmp_path / "bare", opt, data=loader)


def test_a_refused_position_leaves_the_model_loaded(saved: Any, other: Any) -> None:
    path, _, _ = saved
    pipe, _, opt, sched, _ = other
    other = pipe.data_loader(vf.TokenDataset(TOKENS[:1000], 8))  # another dataset
    with pytest.raises(CheckpointError, match="model and optimizer were loaded.*dataset of"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe.load_checkpoint(path, opt, data=other, scheduler=sched)
    x, y = next(iter(other))
    assert torch.isfinite(pipe.step(x, target=y))  # not marked as a failed load


class NotPlain:
    def state_dict(self) -> dict[str, Any]:
        return {"fn": lambda s: s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class NotADict(NotPlain):
    def state_dict(self) -> Any:  # type: ignore[override]
        return [1, 2]


@pytest.mark.parametrize("kwargs, match", [
    ({"scheduler": object()}, "lacks state_dict"),
    ({"stateful": [Counter()]}, "must map names"),
    ({"stateful": {"a/b": Counter()}}, "identifiers"),
    ({"stateful": {"fn": NotPlain()}}, r"stateful\['fn'\]'s state_dict\(\) must hold plain"),
    ({"stateful": {"odd": NotADict()}}, "not a dict"),
])
def test_saving_what_cannot_load_back_safely_is_refused(other: Any, tmp_path: Path,
                                                        kwargs: dict, match: str) -> None:
    pipe = other[0]
    with pytest.raises(CheckpointError, match=match):
        pipe.save_checkpoint(tmp_path / "c", **kwargs)
    assert not (tmp_path / "c").exists()


def test_ranks_whose_states_differ_are_refused() -> None:
    stateful.check_same([{"scheduler": "a", "data": "d"}, {"scheduler": "a", "data": "d"}])
    with pytest.raises(CheckpointError, match="data= differs between the ranks"):
        stateful.check_same([{"scheduler": "a", "data": "d"}, {"scheduler": "a", "data": "e"}])


@pytest.mark.parametrize("make", [
    lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 10),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 1.0, total_steps=10),
    lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, 0.1, total_iters=2),
            torch.optim.lr_scheduler.CosineAnnealingLR(o, 8)], milestones=[2]),
    lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o),
    lambda o: torch.optim.lr_scheduler.CyclicLR(o, 0.01, 0.1),
])
def test_torch_schedulers_are_plain_data(make: Any) -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
    sched = make(opt)
    saved, digests = stateful.entries({"scheduler": sched})
    assert set(saved) == {"obj/state/scheduler"} and len(digests) == 1
