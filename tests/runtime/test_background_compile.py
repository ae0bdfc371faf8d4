"""Stages compiled in the background (``runtime/background_compile.py``): under
``compile_stages="on"`` a new pipeline's stages run eagerly while they compile, the first step
never waits, the switch to the compiled version happens at a step boundary (never mid-step),
numbers stay exact across it, and a compile that fails or hangs leaves the stage eager with a
warning. The fast tests replace the compile (``compile_flat``) with the flat graph run eagerly
behind a gate; one slow test compiles for real."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import varuna_fx as vf
from varuna_fx.runtime import background_compile, compiled_stage
from varuna_fx.runtime.background_compile import BackgroundStage
from varuna_fx.runtime.compiled_stage import CompiledStageWarning

# BatchNorm under micro-batches is warned at compile: here both pipelines share the split
pytestmark = pytest.mark.filterwarnings("ignore::varuna_fx.capture.buffers.MicroBatchStateWarning")

TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # inductor's reordered float sums (docs/API.md)
EXACT = {"rtol": 0.0, "atol": 0.0}


class _Net(nn.Module):
    """Four layers, a skip and a BatchNorm (its statistics: buffers the forward updates)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.norm(self.b(h))) + h
        return self.d(torch.tanh(self.c(h)))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return _Net()


X = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
Y = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _pipe(setting: str, schedule: str = "1f1b", recompute: bool = False,
          loss_fn: Callable[..., torch.Tensor] = _mse) -> vf.Pipeline:
    return vf.compile(_net(), vf.Cluster(gpus=2, device="cpu"), example_inputs=(X,),
                      loss_fn=loss_fn, stages=2, micro_batch_size=2, schedule=schedule,
                      recompute=recompute, compile_stages=setting)


def _stages(pipe: vf.Pipeline) -> list[BackgroundStage]:
    calls = [w.call for w in pipe.runtime.workers]
    assert all(isinstance(c, BackgroundStage) for c in calls)
    return calls  # type: ignore[return-value]


class _Gated:
    """The compile replaced: waits for ``gate`` (at most ``hold`` s), then hands back the flat
    graph run eagerly (so the compiled path is exact), counting its calls."""

    def __init__(self, hold: float = 10.0, fail: str | None = None) -> None:
        self.gate, self.hold, self.fail = threading.Event(), hold, fail
        self.calls = 0
        self.modes: list[tuple[bool, ...]] = []

    def __call__(self, gm: torch.fx.GraphModule, examples: dict[bool, list[torch.Tensor]],
                 *_: Any) -> dict[bool, Callable[..., Any]]:
        grad_modes = tuple(examples)
        self.modes.append(grad_modes)
        self.gate.wait(self.hold)
        if self.fail:
            raise RuntimeError(self.fail)

        def run(*flat: torch.Tensor) -> Any:
            self.calls += 1
            return gm(*flat)
        return {g: run for g in grad_modes}


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    monkeypatch.setenv(compiled_stage.INDUCTOR_CACHE_VAR, str(tmp_path / "inductor"))
    made: list[_Gated] = []

    def make(**kw: Any) -> _Gated:
        fake = _Gated(**kw)
        made.append(fake)
        monkeypatch.setattr(background_compile, "compile_flat", fake)
        return fake
    yield make
    for fake in made:  # never leave the process's compile thread blocked
        fake.gate.set()


def _until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _grads(pipe: vf.Pipeline) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in pipe.named_parameters()}


def test_the_first_step_runs_eagerly_and_the_switch_waits_for_a_step_boundary(
        gated: Any) -> None:
    """Step 1 does not wait for the (held) compile; the compile ends during step 2's first
    micro-batch and step 2 still runs eagerly throughout; step 3 runs compiled. Loss,
    gradients and BatchNorm statistics equal an eager-stage pipeline's on every step."""
    fake = gated()
    stages: list[BackgroundStage] = []

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if step == 2 and not fake.gate.is_set():  # the compile ends mid-step
            fake.gate.set()
            _until(lambda: all(s.ready for s in stages))
        return _mse(out, target)

    eager, pipe = _pipe("off"), _pipe("on", loss_fn=loss_fn)
    stages.extend(_stages(pipe))
    for step in (1, 2, 3):
        for p in (eager, pipe):
            p.zero_grad()
        began = time.perf_counter()
        loss = pipe.step(X, target=Y)
        took = time.perf_counter() - began
        want = eager.step(X, target=Y)
        if step == 1:
            assert took < fake.hold / 2 and all(s.pending and s.compiled is None
                                                for s in stages)
        compiled = [s.compiled is not None for s in stages]
        assert compiled == [step == 3] * 2, (step, compiled)
        assert fake.calls == (8 if step == 3 else 0), (step, fake.calls)  # 4 mb x 2 stages
        torch.testing.assert_close(loss, want, **EXACT)
        got, expected = _grads(pipe), _grads(eager)
        for n, g in expected.items():
            torch.testing.assert_close(got[n], g, **EXACT, msg=lambda m, n=n: f"{n}: {m}")
        for (n, b), (_, e) in zip(pipe.named_buffers(), eager.named_buffers()):
            torch.testing.assert_close(b, e, **EXACT, msg=lambda m, n=n: f"{n}: {m}")
    assert fake.modes == [(True,), (True,)]


def _warned(run: Callable[[], Any]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if issubclass(w.category, CompiledStageWarning)]


@pytest.mark.parametrize("schedule,recompute", [("1f1b", True), ("1f1b-zb", False)])
def test_recompute_and_a_split_backward_stay_exact_across_the_switch(
        gated: Any, schedule: str, recompute: bool) -> None:
    """A recomputing stage compiles for both grad modes (its forward runs under no_grad);
    the recompute's BatchNorm buffer swap reaches the compiled call (buffers are passed per
    call); under a split backward the eager path and the compiled one agree too."""
    fake = gated()
    fake.gate.set()
    eager, pipe = _pipe("off", schedule, recompute), _pipe("on", schedule, recompute)
    for step in range(3):
        for p in (eager, pipe):
            p.zero_grad()
        texts = _warned(lambda: torch.testing.assert_close(
            pipe.step(X, target=Y), eager.step(X, target=Y), **EXACT))
        assert texts == []  # every call as compiled: no eager fallback
        for n, g in _grads(eager).items():
            torch.testing.assert_close(_grads(pipe)[n], g, **EXACT)
        if step == 0:
            _until(lambda: all(s.ready for s in _stages(pipe)))
    assert all(s.compiled is not None for s in _stages(pipe))
    # steps 2 and 3 compiled: 4 forwards per stage, and the first stage's 4 recomputes
    assert fake.calls == 2 * (8 + 4 * recompute), fake.calls
    want = [(False, True), (True,)] if recompute else [(True,), (True,)]
    assert fake.modes == want


class _Dropping(nn.Module):
    """Keyed dropouts of the three kinds a stage calls: nn.Dropout, F.dropout (in place too)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(8, 8) for _ in range(3))
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.a(x)))
        h = torch.nn.functional.dropout(torch.tanh(self.b(h)), 0.2, self.training)
        h = torch.nn.functional.dropout(self.c(h), 0.1, self.training, inplace=True)
        return torch.tanh(h)


@pytest.mark.parametrize("recompute", [False, True])
def test_keyed_dropout_compiles_with_eagers_masks(gated: Any, recompute: bool) -> None:
    """A stage with keyed dropouts compiles (their masks drawn eagerly, inputs of the graph):
    the compiled steps draw exactly the eager-stage pipeline's masks (loss and gradients
    equal bit for bit through the flat graph), the recompute replaying them."""
    fake = gated()
    fake.gate.set()
    pipes = []
    for setting in ("off", "on"):
        torch.manual_seed(0)
        pipes.append(vf.compile(_Dropping(), vf.Cluster(gpus=2, device="cpu"),
                                example_inputs=(X,), loss_fn=_mse, stages=2,
                                micro_batch_size=2, recompute=recompute,
                                compile_stages=setting))
    eager, pipe = pipes
    assert all(s.stage.random and s.failed is None for s in _stages(pipe))
    for step in range(3):
        for p in pipes:
            p.zero_grad()
        torch.manual_seed(10 + step)
        want = eager.step(X, target=Y)
        torch.manual_seed(10 + step)
        torch.testing.assert_close(pipe.step(X, target=Y), want, **EXACT)
        for n, g in _grads(eager).items():
            torch.testing.assert_close(_grads(pipe)[n], g, **EXACT)
        if step == 0:
            _until(lambda: all(s.ready for s in _stages(pipe)))
    assert all(s.compiled is not None for s in _stages(pipe)) and fake.calls


def test_a_background_compile_that_fails_leaves_the_stage_eager_with_a_warning(
        gated: Any) -> None:
    fake = gated(fail="LoweringException: no lowering for aten.frobnicate.default")
    fake.gate.set()
    eager, pipe = _pipe("off"), _pipe("on")
    assert _warned(lambda: pipe.step(X, target=Y)) == []
    _until(lambda: all(s.ready for s in _stages(pipe)))
    pipe.zero_grad()
    texts = _warned(lambda: pipe.step(X, target=Y))
    assert len(texts) == 2 and all("could not compile it in the background" in t and
                                   "aten.frobnicate" in t and "eagerly" in t for t in texts)
    assert all(s.failed and s.compiled is None for s in _stages(pipe))
    assert _warned(lambda: pipe.step(X, target=Y)) == []  # said once
    eager.step(X, target=Y)
    eager.zero_grad()
    pipe.zero_grad()
    torch.testing.assert_close(pipe.step(X, target=Y), eager.step(X, target=Y), **EXACT)


def test_a_background_compile_that_hangs_times_out(gated: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Past $VARUNA_FX_COMPILE_TIMEOUT (counted from the queueing) the stage gives up: eager
    for good, said; the step never waited."""
    gated(hold=30.0)  # released by the fixture
    monkeypatch.setenv("VARUNA_FX_COMPILE_TIMEOUT", "0.2")
    pipe = _pipe("on")
    began = time.perf_counter()
    pipe.step(X, target=Y)
    time.sleep(0.3)
    texts = _warned(lambda: pipe.step(X, target=Y))
    assert time.perf_counter() - began < 10
    assert len(texts) == 2 and all("did not finish within 0.2 s" in t and
                                   "VARUNA_FX_COMPILE_TIMEOUT" in t for t in texts), texts
    assert all(s.failed and not s.pending for s in _stages(pipe))


def test_a_new_pipeline_compiles_its_own_stages_and_a_dropped_ones_queue_is_skipped(
        gated: Any) -> None:
    """A morph or restart makes new stages: they compile in the background in turn, while
    the queued compile of a pipeline no longer held (its stages gone) never runs."""
    import gc

    fake = gated()
    old = _pipe("on")
    old.step(X, target=Y)  # stage 0's compile starts (held at the gate), stage 1's waits
    _until(lambda: len(fake.modes) == 1)
    del old
    gc.collect()
    new = _pipe("on")
    new.step(X, target=Y)  # the first step after the "morph": eager, no wait
    assert all(s.pending and s.compiled is None for s in _stages(new))
    fake.gate.set()
    _until(lambda: all(s.ready for s in _stages(new)))
    new.step(X, target=Y)
    assert all(s.compiled is not None for s in _stages(new))
    assert len(fake.modes) == 3  # the old stage 0's, then the new two: not the old stage 1's


def test_the_compiling_thread_ends_when_idle_and_starts_again(
        gated: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its wait for work is bounded too: idle, it ends; the next compile starts another."""
    fake = gated()
    fake.gate.set()
    monkeypatch.setattr(background_compile._Compiler, "IDLE", 0.05)
    compiler = background_compile.COMPILER
    for _ in range(2):
        pipe = _pipe("on")
        pipe.step(X, target=Y)
        stages = _stages(pipe)
        _until(lambda stages=stages: all(s.ready for s in stages))
        _until(lambda: compiler.thread is None)
    assert len(fake.modes) == 4


def test_the_flat_graph_never_rebinds_the_stage_modules_tensors(gated: Any) -> None:
    """The compile traces a shell of the stage module: running the flat graph on other
    tensors leaves the stage's own parameters and buffers where they were."""
    pipe = _pipe("off")
    stage = pipe.stages[0]
    names = [n for n, _ in stage.module.named_parameters()] + \
        [n for n, _ in stage.module.named_buffers()]
    before = {n: t for n, t in [*stage.module.named_parameters(), *stage.module.named_buffers()]}
    values = {n: X[:2] for n in stage.arg_names}
    keys = list(stage(values))
    gm = background_compile.flat_graph(stage.module, names, len(stage.arg_names), keys)
    others = [torch.zeros_like(before[n]) for n in names]
    out = gm(*others, *[values[n] for n in stage.arg_names])
    assert len(out) == len(keys)
    after = dict([*stage.module.named_parameters(), *stage.module.named_buffers()])
    assert all(after[n] is t for n, t in before.items())


def test_a_call_unlike_the_compiled_one_runs_eagerly_with_a_warning(gated: Any) -> None:
    fake = gated()
    fake.gate.set()
    pipe = _pipe("on")
    pipe.step(X, target=Y)
    _until(lambda: all(s.ready for s in _stages(pipe)))
    stage = _stages(pipe)[0]
    assert stage.at_step_boundary()
    values = {n: X[:3] for n in stage.stage.arg_names}  # a micro-batch of 3, not 2
    texts = _warned(lambda: stage(values))
    assert len(texts) == 1 and "differs from what was compiled" in texts[0]
    assert fake.calls == 0


@pytest.mark.slow
def test_inductor_in_the_background_never_stalls_the_first_step(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A new pipeline (a restart, cold cache) under a split backward: its first step takes a
    fraction of the compile; while the stages compile, the steps (and a global random draw
    each) equal an eager-stage pipeline's exactly (the compile touches no generator); after
    the switch, within inductor's tolerance."""
    monkeypatch.setenv(compiled_stage.INDUCTOR_CACHE_VAR, str(tmp_path / "inductor"))
    eager, pipe = _pipe("off", "1f1b-zb"), _pipe("on", "1f1b-zb")
    stages = _stages(pipe)
    torch.manual_seed(3)
    eager_batches = [torch.randn(8, 8) for _ in range(400)]
    torch.manual_seed(3)
    first = None
    for k in range(400):
        batch = torch.randn(8, 8)  # drawn from the global generator while the thread compiles
        for p in (eager, pipe):
            p.zero_grad()
        began = time.perf_counter()
        loss = pipe.step(batch, target=Y)
        first = first or time.perf_counter() - began
        compiled = all(s.compiled is not None for s in stages)
        tol = TOLERANCE if any(s.compiled is not None for s in stages) else EXACT
        torch.testing.assert_close(batch, eager_batches[k], **EXACT)
        torch.testing.assert_close(loss, eager.step(batch, target=Y), **tol)
        for n, g in _grads(eager).items():
            torch.testing.assert_close(_grads(pipe)[n], g, **tol)
        if compiled:
            break
        time.sleep(0.2)
    assert compiled and all(s.failed is None for s in stages)
    compile_s = max(s.compile_seconds or 0.0 for s in stages)
    assert first is not None and first < compile_s / 4, (first, compile_s)
