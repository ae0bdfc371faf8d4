"""A stage run through torch.compile / inductor (``vf.compile(..., compile_stages="on")``).

:class:`CompiledStage` stands where the worker calls its ``Stage``: the stage's generated
``fx.GraphModule`` goes through ``torch.compile`` (dynamo, then AOTAutograd, which also
compiles the backward, then inductor), so every forward, recompute and backward the worker
runs is compiled code. What it keeps honest:

* **graph breaks and recompiles are counted** (``torch._dynamo``'s counters, read around each
  call) and each is reported in a :class:`CompiledStageWarning`, never silent. A stage under
  recomputation is compiled twice by design (its forward runs under ``no_grad``, the recompute
  with autograd on), and the warning says so.
* **a stage inductor cannot compile runs eagerly**: a call that fails compiled and succeeds
  eagerly switches the stage to eager for good, with a warning naming the error (and so the
  op); a call that fails eagerly too is the model's error and is raised as such.
* **compile is paid once**: inductor's FX-graph and AOTAutograd caches live under
  ``$VARUNA_FX_CACHE_DIR/inductor`` (:func:`use_cache_dir`, unless the user set
  ``TORCHINDUCTOR_CACHE_DIR``), so a restarted or joining process reuses the artefacts.

Numerics: inductor fuses and reorders float sums, so a compiled stage equals its eager self
within float32 rounding (tests use ``rtol=1e-4, atol=1e-5``), not bit for bit.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.fx._lazy_graph_module import _LazyGraphModule

from ..codegen.stage_module import Stage
from ..world.files import cache_dir
from .split_compile import split_backend

INDUCTOR_CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"


class CompiledStageWarning(UserWarning):
    """A compiled stage broke its graph, compiled again, or fell back to eager."""


def use_cache_dir() -> str:
    """Point inductor's caches (FX graphs, AOTAutograd, kernels) at the cache service's
    folder, ``$VARUNA_FX_CACHE_DIR/inductor``, unless ``TORCHINDUCTOR_CACHE_DIR`` is set (by
    the user, or by inductor once it has chosen); returns the folder in use."""
    current = os.environ.get(INDUCTOR_CACHE_VAR)
    if current:
        return current
    folder = cache_dir("inductor")
    folder.mkdir(parents=True, exist_ok=True)
    os.environ[INDUCTOR_CACHE_VAR] = str(folder)
    return str(folder)


def inductor(module: torch.nn.Module, split: bool = False) -> Callable[..., Any]:
    """The compile call (tests replace it to make a stage fail to compile). Static shapes:
    every micro-batch of a plan has the same size. ``split``: its backward in two halves, for
    a split-backward schedule (split_compile.py)."""
    if isinstance(module, _LazyGraphModule):
        # its Python is made on the first call, by a function dynamo skips (a graph break):
        # make it now, so dynamo traces the stage's own forward in one graph
        module.real_recompile()
    backend: Any = split_backend if split else "inductor"
    return torch.compile(module, backend=backend, dynamic=False)


def _counts() -> tuple[int, dict[str, int]]:
    """(graphs dynamo has made, graph breaks by reason) so far in this process."""
    from torch._dynamo.utils import counters  # a private module: imported where used

    return counters["stats"]["unique_graphs"], dict(counters["graph_break"])


class CompiledStage:
    """``stage`` called through torch.compile, with the stats and the fallback above."""

    def __init__(self, stage: Stage, split: bool = False) -> None:
        """``split``: the stage's backward in an input half and a weight half."""
        self.stage = stage
        self.split = split
        self._fn: Callable[..., Any] | None = None
        self.failed: str | None = None  # why the stage runs eagerly, once it does
        self.graphs = 0  # dynamo graphs made for this stage (more than one per mode: breaks)
        self.breaks: dict[str, int] = {}  # graph breaks by reason
        self.recompiles = 0  # compiles after the first (a new grad mode, shape or dtype)
        self._modes: set[bool] = set()  # grad modes compiled for
        if stage.random:
            # keyed draws read the micro-batch's key (ir/rng.py) from Python state and seed a
            # generator per sample, which dynamo guards on or breaks at; eager keeps their
            # numbers exact (the stage's other ops are not compiled either, for now)
            self.failed = ("its keyed random ops (dropout) are not compiled yet: they read "
                           "each micro-batch's key from Python state")
        self._said = False

    def __call__(self, values: dict[str, Any]) -> dict[str, Any]:
        if self.failed is not None:
            if not self._said:
                self._said = True
                warnings.warn(f"stage {self.stage.index} runs eagerly under compile_stages: "
                              f"{self.failed}", CompiledStageWarning, stacklevel=3)
            return self.stage(values)
        args = [values[name] for name in self.stage.arg_names]
        graphs, breaks = _counts()
        try:
            if self._fn is None:
                use_cache_dir()
                self._fn = inductor(self.stage.module, self.split)
            result = self._fn(*args)
        except Exception as exc:  # noqa: BLE001 - compiled failed: eager tells whose fault
            result = self.stage(values)  # the model's own error is raised from here
            self.failed = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
            self._said = True
            warnings.warn(
                f"stage {self.stage.index}: torch.compile / inductor could not compile it "
                f"({self.failed}); the stage runs eagerly from now on (its numbers are eager's; "
                "compile_stages='off' silences this)", CompiledStageWarning, stacklevel=3)
            return result
        self._account(graphs, breaks, torch.is_grad_enabled())
        return result

    def _account(self, graphs: int, breaks: dict[str, int], grad: bool) -> None:
        """Count what the call compiled and warn about breaks and recompiles."""
        now_graphs, now_breaks = _counts()
        made = now_graphs - graphs
        if not made:
            return
        new = {r: n - breaks.get(r, 0) for r, n in now_breaks.items() if n > breaks.get(r, 0)}
        for reason, n in new.items():
            self.breaks[reason] = self.breaks.get(reason, 0) + n
        first = self.graphs == 0
        self.graphs += made
        if new:
            shown = "; ".join(f"{r[:200]} (x{n})" for r, n in list(new.items())[:3])
            warnings.warn(
                f"stage {self.stage.index}: torch.compile broke its graph {sum(new.values())} "
                f"time(s) ({made} graphs; eager Python runs between them): {shown}",
                CompiledStageWarning, stacklevel=4)
        if not first:
            self.recompiles += 1
            why = ("expected: the stage recomputes, so its forward runs under no_grad and its "
                   "recompute with autograd" if grad not in self._modes and self._modes
                   else "a guard failed: a new shape, dtype or module state")
            warnings.warn(
                f"stage {self.stage.index}: compiled again (recompile {self.recompiles}; "
                f"{why})", CompiledStageWarning, stacklevel=4)
        self._modes.add(grad)
