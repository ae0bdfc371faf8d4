"""Compiled stages (``compile_stages``, ``runtime/compiled_stage.py``): the option resolves in
the plan, compiled pipelines equal eager within compiled tolerance under 1F1B, a split
backward and recompute, graph breaks and recompiles are warned, and a stage inductor cannot
compile runs eagerly with a warning naming the error.

These pass ``compile_wait=True``: the first call compiles (torch.compile), as they check;
tests/runtime/test_background_compile.py has the default, a compile in the background.
Inductor compiles take seconds each on CPU: one slow test compiles for real (three pipelines
of a tiny MLP, the later ones from inductor's cache); the rest replace the compile call."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import varuna_fx as vf
from varuna_fx.planner.plan import resolve_compile_stages
from varuna_fx.runtime import compiled_stage, split_compile, worker
from varuna_fx.runtime.compiled_stage import CompiledStageWarning
from varuna_fx.schedule import schedule_spec

# inductor fuses and reorders float32 sums: equal to eager within rounding (docs/API.md)
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


class _Residual(nn.Module):
    """Four layers with a skip: under a split backward with several micro-batches, inductor's
    donated buffers let the input half overwrite values the weight half reads (wrong weight
    gradients until split_compile turned donation off)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h)) + h
        return self.d(torch.tanh(self.c(h)))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return _Residual()


X, Y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), \
    torch.randn(4, 8, generator=torch.Generator().manual_seed(2))


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _eager() -> tuple[float, dict[str, torch.Tensor]]:
    model = _mlp()
    loss = _mse(model(X), Y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _step(schedule: str, recompute: bool, ranks: int = 2, **tol: float) -> list[str]:
    """One step of a compiled pipeline on ``ranks`` ranks (a virtual schedule: 2 stages per
    rank) against eager; returns the warnings' texts."""
    want_loss, want = _eager()
    v = schedule_spec(schedule).stages_per_rank
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = vf.compile(_mlp(), vf.Cluster(gpus=ranks, device="cpu"), example_inputs=(X,),
                          loss_fn=_mse, stages=v * ranks, stages_per_rank=v, schedule=schedule,
                          micro_batch_size=1, recompute=recompute, compile_stages="on",
                          compile_wait=True)
        assert pipe.plan.compile_stages and pipe.plan.recompute[0] == recompute
        loss = pipe.step(X, target=Y)
    torch.testing.assert_close(float(loss), want_loss, **(tol or TOLERANCE))
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, want[n], **(tol or TOLERANCE),
                                   msg=lambda m, n=n: f"{schedule}: {n}: {m}")
    return [str(w.message) for w in caught if issubclass(w.category, CompiledStageWarning)]


def _replace_compile(monkeypatch: pytest.MonkeyPatch,
                     fn: Callable[..., Callable[..., Any]], tmp_path: Path) -> None:
    monkeypatch.setenv(compiled_stage.INDUCTOR_CACHE_VAR, str(tmp_path / "inductor"))
    monkeypatch.setattr(compiled_stage, "inductor", fn)


# -- the option ---------------------------------------------------------------------------------

def test_auto_compiles_on_cuda_clusters_and_not_on_cpu() -> None:
    on_cpu = resolve_compile_stages("auto", vf.Cluster(gpus=1, device="cpu"))
    assert on_cpu[0] is False and "CPU" in on_cpu[1] and "compile_stages='on'" in on_cpu[1]
    assert resolve_compile_stages("auto", vf.Cluster(gpus=1, device="cuda"))[0] is True
    assert resolve_compile_stages("on", None)[0] is True
    assert resolve_compile_stages("off", vf.Cluster(gpus=1, device="cuda")) == (False, "")


def test_auto_on_a_cuda_plan_stepped_on_cpu_runs_eager_stages(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A plan for a CUDA cluster compiles ("auto"), but stepped on CPU (tests, notebooks) its
    stages run eagerly; "on" compiles wherever it runs."""
    calls: list[int] = []
    _replace_compile(monkeypatch, lambda module, *_: calls.append(1) or module, tmp_path)
    for setting, compiled in (("auto", False), ("on", True)):
        calls.clear()
        pipe = vf.compile(_mlp(), vf.Cluster(gpus=2, device="cuda"), example_inputs=(X,),
                          loss_fn=_mse, stages=2, micro_batch_size=1, compile_stages=setting,
                          compile_wait=True)
        assert pipe.plan.compile_stages and pipe.plan.compiles_on("cuda")
        pipe.step(X, target=Y)
        assert bool(calls) is compiled, setting


def test_the_plan_says_whether_stages_are_compiled() -> None:
    pipe = vf.compile(_mlp(), vf.Cluster(gpus=1, device="cpu"), example_inputs=(X,),
                      loss_fn=_mse, stages=1)
    assert pipe.plan.compile_stages is False and "stages: eager" in str(pipe.plan)
    assert "compiled (inductor)" not in str(pipe.plan)


def test_the_train_command_passes_compile_stages_on() -> None:
    from varuna_fx.errors import InputError
    from varuna_fx.train.checks import resolve

    cfg, source = resolve(["--compile-stages", "on"])
    assert cfg.compile_options()["compile_stages"] == "on" and source == {
        "compile_stages": "command line"}
    assert resolve([])[0].compile_options()["compile_stages"] == "auto"
    assert resolve([])[0].compile_options()["compile_wait"] is False
    assert resolve(["--compile-wait"])[0].compile_options()["compile_wait"] is True
    with pytest.raises(InputError, match="compile_stages"):
        resolve(["--compile-stages", "max"])


# -- the compiled path without inductor's cost ----------------------------------------------------

@pytest.mark.parametrize("schedule,recompute", [("1f1b-zb", False), ("1f1b", True),
                                                ("interleaved-1f1b", False), ("zbv", False),
                                                ("dualpipev", False), ("dualpipev", True)])
def test_the_compiled_path_is_exact_with_an_identity_compile(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, schedule: str, recompute: bool) -> None:
    """The worker's compiled path (a split backward run whole at B, W empty; the recompute
    through the compiled call) with the compile call replaced by the module itself."""
    _replace_compile(monkeypatch, lambda module, *_: module, tmp_path)
    assert _step(schedule, recompute) == []


def test_a_stage_inductor_cannot_compile_runs_eagerly_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def failing(module: nn.Module, *_: Any) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            raise RuntimeError("LoweringException: no lowering for aten.frobnicate.default")
        return run

    _replace_compile(monkeypatch, failing, tmp_path)
    texts = _step("1f1b", False)
    assert len(texts) == 2, texts  # once per stage, not once per micro-batch
    assert all("could not compile" in t and "aten.frobnicate" in t and "eagerly" in t
               for t in texts)


def test_a_compile_call_that_raises_falls_back_too(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    def refuses(module: nn.Module, *_: Any) -> Callable[..., Any]:
        raise RuntimeError("inductor is not available here")

    _replace_compile(monkeypatch, refuses, tmp_path)
    texts = _step("1f1b", False)
    assert texts and all("inductor is not available here" in t for t in texts)


def test_the_models_own_error_is_raised_not_hidden(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    """A call that fails eagerly too is the model's (here: a wrong shape), raised as such."""
    def failing(module: nn.Module, *_: Any) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            raise RuntimeError("compiled failed")
        return run

    _replace_compile(monkeypatch, failing, tmp_path)
    pipe = vf.compile(_mlp(), vf.Cluster(gpus=1, device="cpu"), example_inputs=(X,),
                      loss_fn=_mse, stages=1)
    stage = compiled_stage.CompiledStage(pipe.stages[0])
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        stage({name: torch.randn(4, 3) for name in pipe.stages[0].arg_names})


def test_a_stage_with_keyed_dropout_runs_eagerly_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Under torch.compile (compile_wait=True) keyed random ops are not compiled: such a stage
    runs eagerly, said once, and draws the masks an eager-stage pipeline draws (the
    background path compiles keyed dropout: test_background_compile.py)."""
    _replace_compile(monkeypatch, lambda module, *_: module, tmp_path)
    grads, caught = [], []
    for setting in ("off", "on"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 8))
        pipe = vf.compile(model, vf.Cluster(gpus=2, device="cpu"), example_inputs=(X,),
                          loss_fn=_mse, stages=2, micro_batch_size=1, compile_stages=setting,
                          compile_wait=True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.manual_seed(5)
            pipe.step(X, target=Y)
        grads.append({n: p.grad.clone() for n, p in pipe.named_parameters()})
        caught.append([str(w.message) for w in seen
                       if issubclass(w.category, CompiledStageWarning)])
    assert caught[0] == [] and len(caught[1]) >= 1
    assert all("runs eagerly" in t and "dropout" in t for t in caught[1])
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=0, atol=0)


def test_graph_breaks_and_recompiles_are_warned(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    """dynamo's counters, moved as a stage with one graph break would move them."""
    from torch._dynamo.utils import counters

    def breaking(module: nn.Module, *_: Any) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            if not getattr(run, "done", {}).get(torch.is_grad_enabled()):
                counters["stats"]["unique_graphs"] += 2
                counters["graph_break"]["print() is not traceable"] += 1
                run.done = {**getattr(run, "done", {}), torch.is_grad_enabled(): True}  # type: ignore[attr-defined]
            return module(*args)
        return run

    _replace_compile(monkeypatch, breaking, tmp_path)
    texts = _step("1f1b", True)
    breaks = [t for t in texts if "broke its graph" in t]
    assert breaks and all("print() is not traceable" in t for t in breaks)
    recompiles = [t for t in texts if "compiled again" in t]
    assert len(recompiles) == 1 and "stage 0" in recompiles[0] and "no_grad" in recompiles[0]


# -- inductor for real ------------------------------------------------------------------------------

@pytest.mark.slow
def test_inductor_stages_equal_eager_under_1f1b_split_backward_dualpipev_and_recompute(
        monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Three compiled P=2 pipelines and DualPipeV's two stages on one rank (the later ones
    partly from inductor's cache): loss and every gradient within TOLERANCE of eager; no
    graph break, and the only recompile is the recomputing stage's no_grad / autograd pair;
    under the split backward every B queues its compiled weight half (4 micro-batches: the
    donated-buffer case)."""
    cache = tmp_path_factory.mktemp("inductor")
    monkeypatch.setenv(compiled_stage.INDUCTOR_CACHE_VAR, str(cache))
    assert _step("1f1b", False) == []
    taken: list[int] = []

    def spy(mark: int) -> split_compile.CompiledWeights:
        weights = split_compile.take_pending(mark)
        taken.append(len(weights.work))
        return weights

    monkeypatch.setattr(worker, "take_pending", spy)
    assert _step("1f1b-zb", False) == []
    # every B of both stages queued its compiled weight half for its W
    assert taken == [1] * 8, taken
    # DualPipeV with both halves of the V on one rank: the same two stage graphs (inductor's
    # cache), its whole backwards (W right after B) and its deferred ones alike
    taken.clear()
    assert _step("dualpipev", False, ranks=1) == []
    assert taken == [1] * 8, taken
    texts = _step("1f1b", True)
    assert len(texts) == 1 and "stage 0: compiled again" in texts[0], texts
    assert any(cache.rglob("*")), "inductor's artefacts land in the cache folder"
    # int8 boundaries depart from eager by design: compiled stages equal eager stages under
    # the same codec (the one-process runtime applies it between the two "ranks")
    got = {}
    for setting in ("off", "on"):
        pipe = vf.compile(_mlp(), vf.Cluster(gpus=2, device="cpu"), example_inputs=(X,),
                          loss_fn=_mse, stages=2, micro_batch_size=1, schedule="1f1b",
                          compression="int8", compile_stages=setting, compile_wait=True)
        assert pipe.plan.compression == ("int8",)
        loss = pipe.step(X, target=Y)
        got[setting] = float(loss), {n: p.grad.clone() for n, p in pipe.named_parameters()}
    torch.testing.assert_close(got["on"][0], got["off"][0], **TOLERANCE)
    for n, g in got["off"][1].items():
        torch.testing.assert_close(got["on"][1][n], g, **TOLERANCE)
