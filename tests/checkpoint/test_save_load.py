"""Checkpoints in one process: complete state, exact resume under other layouts, async saves,
atomicity against kill -9, the errors for bad checkpoints, and the preemption flag."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import varuna_fx as vf
from support.training import (
    CKPT_SPLIT,
    CKPT_STEPS,
    CKPT_TOL,
    ckpt_eager_training,
    ckpt_model,
    ckpt_optimizer,
    ckpt_tokens,
)
from varuna_fx.examples import lm_loss
from varuna_fx.runtime import preemption


def compile_at(stages: int, micro: int = 2, schedule: str = "varuna",
               dropout: float = 0.0) -> vf.Pipeline:
    data = ckpt_tokens()
    return vf.compile(ckpt_model(dropout=dropout), example_inputs=(data[0, :, :-1],),
                      loss_fn=lm_loss, stages=stages, micro_batch_size=micro, schedule=schedule)


def train(pipe: vf.Pipeline, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    data = ckpt_tokens()
    losses = []
    for step in steps:
        pipe.zero_grad()
        losses.append(float(pipe.step(data[step, :, :-1], target=data[step, :, 1:])))
        opt.step()
    return losses


@pytest.fixture(scope="module")
def eager() -> dict[str, torch.Tensor]:
    return ckpt_eager_training()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CKPT_SPLIT steps at P=2, saved (with an extra dict)."""
    pipe = compile_at(2)
    opt = ckpt_optimizer(pipe.parameters())
    train(pipe, opt, range(CKPT_SPLIT))
    path = tmp_path_factory.mktemp("ckpt") / f"step{CKPT_SPLIT:08d}"
    pipe.save_checkpoint(str(path), optimizer=opt, extra={"step": CKPT_SPLIT, "note": "p2"})
    return path


def test_state_dict_is_the_whole_model() -> None:
    pipe = compile_at(3)
    model = ckpt_model()
    state = pipe.state_dict()
    # every parameter and buffer once: the tied LM head under the embedding's name
    assert set(state) == set(model.state_dict()) - {"lm_head.weight"}
    assert {"aux_head.weight", "aux_head.bias", "version"} <= set(state)
    assert "aux_head.weight" in dict(pipe.named_parameters())  # an optimizer gets it too
    for name, value in model.state_dict().items():
        torch.testing.assert_close(state[pipe.canonical[name]], value)


class DeadCode(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.dead = torch.nn.Linear(4, 4)  # called, result unused
        self.never = torch.nn.Linear(4, 2)  # never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        unused = self.dead(x)  # noqa: F841
        return self.b(self.a(x)).mean()


def test_parameters_only_dead_code_reads_are_held() -> None:
    model = DeadCode()
    pipe = vf.compile(model, example_inputs=(torch.randn(4, 4),), stages=2)
    assert sorted(n for n, _ in pipe.named_parameters()) == \
        sorted(n for n, _ in model.named_parameters())
    assert sorted(pipe.state_dict()) == sorted(model.state_dict())
    pipe.step(torch.randn(4, 4))
    assert model.never.weight.grad is None  # as in eager: no gradient, so no optimizer update


def test_load_state_dict_refuses_wrong_shapes_and_unknown_keys() -> None:
    pipe = compile_at(2)
    state = {n: t.detach().clone() for n, t in pipe.state_dict().items()}
    bad = next(n for n, t in state.items() if t.dim() == 2)
    shape = tuple(state[bad].shape)
    with pytest.raises(vf.InputError, match=rf"{bad}: \(1, {shape[1]}\) given"):
        pipe.load_state_dict({**state, bad: torch.ones(1, shape[1], dtype=torch.float64)})
    with pytest.raises(vf.InputError, match="keys the model does not have: head.extra"):
        pipe.load_state_dict({**state, "head.extra": torch.ones(2)})
    pipe.load_state_dict({**state, "head.extra": torch.ones(2)}, strict=False)
    with pytest.raises(vf.InputError, match="lacks 1 of the model's entries: version"):
        pipe.load_state_dict({k: v for k, v in state.items() if k != "version"})
    # a tied weight under its other name (as model.state_dict() has it) is accepted
    state["wte.weight"] = torch.zeros_like(state["wte.weight"])
    eager = {k: v for k, v in state.items() if k != "wte.weight"}
    eager["lm_head.weight"] = torch.full_like(state["wte.weight"], 2.0)
    pipe.load_state_dict(eager)
    assert bool((pipe.state_dict()["wte.weight"] == 2.0).all())


@pytest.mark.parametrize("stages,micro,schedule", [
    (3, 4, "1f1b"), pytest.param(1, 8, "gpipe", marks=pytest.mark.slow),
    pytest.param(4, 1, "varuna", marks=pytest.mark.slow)])
def test_resume_under_another_layout_equals_uninterrupted(saved: Path, eager: dict,
                                                          stages: int, micro: int,
                                                          schedule: str) -> None:
    torch.manual_seed(123)  # a different model init: everything must come from the checkpoint
    pipe = vf.compile(ckpt_model(seed=7), example_inputs=(ckpt_tokens()[0, :, :-1],),
                      loss_fn=lm_loss, stages=stages, micro_batch_size=micro, schedule=schedule)
    opt = ckpt_optimizer(pipe.parameters())
    assert vf.latest_checkpoint(saved.parent) == str(saved)
    extra = pipe.load_checkpoint(str(saved), optimizer=opt)
    assert extra == {"step": CKPT_SPLIT, "note": "p2"}
    train(pipe, opt, range(extra["step"], CKPT_STEPS))
    state = pipe.state_dict()
    for name, value in state.items():
        torch.testing.assert_close(value.detach(), eager[name], **CKPT_TOL,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_resume_of_a_model_built_under_skip_init(saved: Path, eager: dict) -> None:
    with vf.skip_init():  # no init: everything must come from the checkpoint
        model = ckpt_model(seed=7)
    pipe = vf.compile(model, example_inputs=(ckpt_tokens()[0, :, :-1],), loss_fn=lm_loss, stages=2,
                      micro_batch_size=4)
    opt = ckpt_optimizer(pipe.parameters())
    extra = pipe.load_checkpoint(str(saved), optimizer=opt)
    train(pipe, opt, range(extra["step"], CKPT_STEPS))
    for name, value in pipe.state_dict().items():
        torch.testing.assert_close(value.detach(), eager[name], **CKPT_TOL,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow  # trains twice more
def test_dropout_masks_continue_after_resume(tmp_path: Path) -> None:
    """The step seeds (dropout) come from the RNG state the checkpoint restores."""
    torch.manual_seed(5)
    whole = compile_at(2, dropout=0.2)
    opt = ckpt_optimizer(whole.parameters())
    expected = train(whole, opt, range(CKPT_STEPS))
    torch.manual_seed(5)
    first = compile_at(2, dropout=0.2)
    opt = ckpt_optimizer(first.parameters())
    train(first, opt, range(CKPT_SPLIT))
    first.save_checkpoint(str(tmp_path / "c"), optimizer=opt)
    torch.manual_seed(99)
    # another depth and micro-batch size: the same masks (keyed by the sample, ir/rng.py)
    second = compile_at(3, micro=1, dropout=0.2)
    opt = ckpt_optimizer(second.parameters())
    second.load_checkpoint(str(tmp_path / "c"), optimizer=opt)
    torch.testing.assert_close(train(second, opt, range(CKPT_SPLIT, CKPT_STEPS)), expected[CKPT_SPLIT:], **CKPT_TOL)


@pytest.mark.slow  # waits for a background save
def test_async_save_writes_the_state_at_the_call(tmp_path: Path) -> None:
    pipe = compile_at(2)
    opt = ckpt_optimizer(pipe.parameters())
    train(pipe, opt, range(1))
    before = {n: t.detach().clone() for n, t in pipe.state_dict().items()}
    handle = pipe.save_checkpoint(str(tmp_path / "a"), optimizer=opt, async_save=True)
    train(pipe, opt, range(1, 3))  # runs while the shards are written
    assert handle.result(timeout=60) == str(tmp_path / "a")
    assert vf.latest_checkpoint(tmp_path) == str(tmp_path / "a")
    other = compile_at(3)
    with pytest.warns(UserWarning, match="no optimizer was passed"):
        other.load_checkpoint(str(tmp_path / "a"))
    for name, value in other.state_dict().items():
        torch.testing.assert_close(value.detach(), before[name], rtol=0, atol=0)
    # a second async save waits for nothing pending; close() waits for it
    pipe.save_checkpoint(str(tmp_path / "b"), optimizer=opt, async_save=True)
    pipe.close()
    assert vf.latest_checkpoint(tmp_path) == str(tmp_path / "b")


def test_latest_checkpoint_skips_incomplete(tmp_path: Path) -> None:
    assert vf.latest_checkpoint(tmp_path / "none") is None
    assert vf.latest_checkpoint(tmp_path) is None
    pipe = compile_at(1)
    pipe.save_checkpoint(str(tmp_path / "b"))
    pipe.save_checkpoint(str(tmp_path / "a"))  # newer, though its name sorts first
    (tmp_path / "c.partial").mkdir()  # what a killed save leaves
    (tmp_path / "notes").mkdir()  # unrelated directories are ignored
    with pytest.warns(UserWarning, match=r"skipping incomplete checkpoint .*c\.partial"):
        assert vf.latest_checkpoint(tmp_path) == str(tmp_path / "a")
    pipe.save_checkpoint(str(tmp_path / "b"))  # replacing a checkpoint is allowed
    with pytest.warns(UserWarning):
        assert vf.latest_checkpoint(tmp_path) == str(tmp_path / "b")


@pytest.mark.slow  # saves and corrupts several checkpoints
def test_bad_checkpoints_are_named(tmp_path: Path, saved: Path) -> None:
    pipe = compile_at(2)
    opt = ckpt_optimizer(pipe.parameters())
    with pytest.raises(vf.CheckpointError, match="no such directory"):
        pipe.load_checkpoint(str(tmp_path / "missing"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(vf.CheckpointError, match="not a complete varuna_fx checkpoint"):
        pipe.load_checkpoint(str(tmp_path / "plain"))
    (tmp_path / "plain" / "data.txt").write_text("mine")
    with pytest.raises(vf.CheckpointError, match="exists and is not a checkpoint"):
        pipe.save_checkpoint(str(tmp_path / "plain"))
    with pytest.raises(vf.CheckpointError, match="extra must hold plain data"):
        pipe.save_checkpoint(str(tmp_path / "x"), extra={"f": object()})
    # another model: one layer more, no auxiliary head, a larger vocabulary
    from support.training import CONFIG
    from varuna_fx.examples import GPT, GPTConfig
    other = GPT(GPTConfig(**{**CONFIG.__dict__, "n_layer": 3, "vocab_size": 100})).double()
    other_pipe = vf.compile(other, example_inputs=(ckpt_tokens()[0, :, :-1],), loss_fn=lm_loss,
                            stages=1)
    with pytest.raises(vf.CheckpointError, match=r"another model \(missing 12: "
                       r"h\.2\..*unexpected 3: aux_head.weight, aux_head.bias, "
                       r"version; shape mismatches: wte\.weight \(96, 32\) saved, "
                       r"\(100, 32\) now\)"):
        other_pipe.load_checkpoint(str(saved))
    with pytest.warns(UserWarning, match="holds torch.optim.adamw.AdamW state but no optimizer"):
        pipe.load_checkpoint(str(saved))
    sgd = torch.optim.SGD(pipe.parameters(), lr=0.1)
    with pytest.raises(vf.CheckpointError, match="state of a torch.optim.adamw.AdamW, not of "
                       "the torch.optim.sgd.SGD passed"):
        pipe.load_checkpoint(str(saved), optimizer=sgd)
    pipe.save_checkpoint(str(tmp_path / "no_opt"))
    with pytest.raises(vf.CheckpointError, match="holds no optimizer state"):
        pipe.load_checkpoint(str(tmp_path / "no_opt"), optimizer=opt)
    foreign = ckpt_optimizer([*pipe.parameters(), torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(vf.CheckpointError, match="1 tensors that are not parameters"):
        pipe.save_checkpoint(str(tmp_path / "y"), optimizer=foreign)


def test_a_damaged_data_file_is_named(tmp_path: Path, saved: Path) -> None:
    copy = tmp_path / saved.name
    shutil.copytree(saved, copy)
    data = max(copy.glob("*.raw"), key=lambda f: f.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # cut short
    pipe = compile_at(2)
    with pytest.raises(vf.CheckpointError, match="damaged or incomplete: load an earlier"):
        pipe.load_checkpoint(str(copy), optimizer=ckpt_optimizer(pipe.parameters()))
    data.unlink()
    with pytest.raises(vf.CheckpointError, match="damaged or incomplete"):
        pipe.load_checkpoint(str(copy), optimizer=ckpt_optimizer(pipe.parameters()))


@pytest.mark.slow  # fp16 and two optimizers
def test_param_groups_and_loss_scale_survive(tmp_path: Path) -> None:
    pipe = compile_at(2)
    named = dict(pipe.named_parameters())
    decay = [p for n, p in named.items() if n.endswith("weight")]
    rest = [p for n, p in named.items() if not n.endswith("weight")]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 0.1}, {"params": rest}],
                          lr=0.5, momentum=0.9)
    train(pipe, opt, range(1))
    opt.param_groups[0]["lr"] = 0.25  # as a scheduler would
    scaler = pipe.runtime.scaler
    scaler.enabled, scaler.scale, scaler._clean_steps = True, 1024.0, 7  # as fp16 would have it
    pipe.save_checkpoint(str(tmp_path / "g"), optimizer=opt)
    other = compile_at(3)
    other.runtime.scaler.enabled = True
    named = dict(other.named_parameters())
    opt2 = torch.optim.SGD([{"params": [p for n, p in named.items() if n.endswith("weight")]},
                            {"params": [p for n, p in named.items()
                                        if not n.endswith("weight")]}], lr=0.5, momentum=0.9)
    other.load_checkpoint(str(tmp_path / "g"), optimizer=opt2)
    assert [g["lr"] for g in opt2.param_groups] == [0.25, 0.5]
    assert [g["weight_decay"] for g in opt2.param_groups] == [0.1, 0]
    momentum = {n: opt.state[p]["momentum_buffer"] for n, p in pipe.named_parameters()
                if p in opt.state}
    assert momentum and all(torch.equal(opt2.state[named[n]]["momentum_buffer"], m)
                            for n, m in momentum.items())
    assert (other.runtime.scaler.scale, other.runtime.scaler._clean_steps) == (1024.0, 7)
    mixed = torch.optim.SGD(other.parameters(), lr=0.5, momentum=0.9)  # one group now
    with pytest.raises(vf.CheckpointError, match="different hyperparameters"):
        other.load_checkpoint(str(tmp_path / "g"), optimizer=mixed)


def test_preemption_signal_sets_preempted_after_the_step() -> None:
    pipe = compile_at(2)
    opt = ckpt_optimizer(pipe.parameters())
    chained = []
    previous = {s: signal.getsignal(s) for s in preemption.SIGNALS}
    signal.signal(signal.SIGUSR1, lambda s, f: chained.append(s))
    try:
        pipe.install_preemption_handlers()
        train(pipe, opt, range(1))
        assert not pipe.preempted
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)  # Python runs the handler at the next bytecode
        assert not pipe.preempted  # only after a step
        train(pipe, opt, range(1, 2))
        assert pipe.preempted
        assert chained == [signal.SIGUSR1]  # the earlier handler still ran
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        preemption._installed.clear()
        preemption.clear()


def test_a_signal_during_a_step_stops_after_that_step() -> None:
    """The flag is read when the step's work is done, so a preemption that lands mid-step
    (here: from inside the loss function) is acted on after that step, not a step later."""
    data = ckpt_tokens()
    pipe = vf.compile(ckpt_model(), example_inputs=(data[0, :, :-1],), stages=2,
                      micro_batch_size=2,
                      loss_fn=lambda out, y: (os.kill(os.getpid(), signal.SIGUSR1),
                                              lm_loss(out, y))[1])
    previous = {s: signal.getsignal(s) for s in preemption.SIGNALS}
    try:
        pipe.install_preemption_handlers()
        pipe.step(data[0, :, :-1], target=data[0, :, 1:])
        assert pipe.preempted
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        preemption._installed.clear()
        preemption.clear()


KILL_CHILD = """
import sys, torch, varuna_fx as vf
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])  # 4.2M parameters
pipe = vf.compile(model, example_inputs=(torch.randn(4, 1024),), stages=2,
                  loss_fn=lambda out, t: out.square().mean())
for i in range(1, 1000):
    with torch.no_grad():
        for p in pipe.parameters():
            p.fill_(i)  # checkpoint i must hold i everywhere, never a mix
    pipe.save_checkpoint(f"{sys.argv[1]}/step{i:04d}", extra={"step": i})
    print("saved", i, flush=True)
"""


@pytest.mark.slow
def test_kill_9_mid_save_leaves_earlier_checkpoints_loadable(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(vf.__file__).parents[1])}
    loader = None
    for attempt, delay in enumerate((0.02, 0.13)):  # a save takes ~0.1-0.3 s
        out = tmp_path / f"run{attempt}"
        child = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(out)], env=env,
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        assert child.stdout.readline().startswith("saved 1")  # one complete checkpoint
        time.sleep(delay)  # then kill -9 somewhere in a later save
        child.send_signal(signal.SIGKILL)
        child.wait()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            latest = vf.latest_checkpoint(out)
        partial = [p.name for p in out.iterdir() if p.name.endswith(".partial")]
        assert all(any(n in str(w.message) for w in caught) for n in partial)
        assert latest is not None
        if loader is None:
            from torch import nn
            loader = vf.compile(nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]),
                                example_inputs=(torch.randn(4, 1024),), stages=3,
                                loss_fn=lambda out, t: out.square().mean())
        # a killed save leaves its .partial and its (released) <path>.lock file
        for path in sorted(p for p in out.iterdir()
                           if p.is_dir() and not p.name.endswith(".partial")):
            extra = loader.load_checkpoint(str(path))
            assert str(path) <= latest
            assert all(bool((p == extra["step"]).all()) for p in loader.parameters()), path
