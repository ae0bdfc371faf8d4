"""Keeps the two test tiers honest (see tests/tiers.py).

* A test outside the slow tier that launches a process fails, naming the marker it needs:
  ``pytest -m "not slow"`` stays a one-process quick check.
* After the run, fast-tier tests that took more than a few CPU-seconds are listed, so a slow
  test that slipped into the fast tier is seen (a list, not a failure: CI machines are shared).
* After collection the objects created so far (torch, transformers, the registry's models) are
  frozen out of the garbage collector: every later full collection, and the five pytest runs
  at exit, would otherwise walk them all again (1-2 s of CPU).
* Every test gets its own (empty, created on first write) directory for the on-disk caches,
  graphs and profiles (``$VARUNA_FX_CACHE_DIR``, inherited by the processes it launches; the
  old profiles-only alias ``$VARUNA_FX_CACHE`` is dropped from the environment): tests never
  write to ~/.cache and never hit an entry another test wrote; the caches' sealing key is a
  temporary file too (``$VARUNA_FX_CACHE_KEY``), never ~/.config's.
* Plans use one stated machine (``$VARUNA_FX_MACHINE`` = ``tests/support/machine.json``),
  not this host's measured costs (planner/machine.py), so they are the same on every host.
* matplotlib's font cache is built before the first test: on a fresh install its first
  ``import matplotlib.font_manager`` runs ``fc-list``, which the guard above would count as the
  test launching a process.
* ``one_capture_per_model``: sweeps that compile the same unchanged model many times capture it
  once (see the fixture).
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing.process
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest

import varuna_fx.passes.frontend

FAST_TEST_CPU_LIMIT = 3.0  # seconds of CPU for one fast-tier test before it is listed
_LAUNCHES = "launches a process"


def _is_slow(item: pytest.Item) -> bool:
    return item.get_closest_marker("slow") is not None


def _refuse(*_: Any, **__: Any) -> None:
    raise RuntimeError(f"this test {_LAUNCHES}: mark it @pytest.mark.slow (and "
                       "@pytest.mark.distributed if it starts ranks), so that "
                       "pytest -m 'not slow' stays a quick one-process check")


@pytest.fixture(autouse=True)
def _fast_tests_launch_no_process(request: pytest.FixtureRequest,
                                  monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if not _is_slow(request.node):
        # every subprocess.* call and multiprocessing's start go through these
        monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse)
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse)
        monkeypatch.setattr(os, "fork", _refuse)
        monkeypatch.setattr(os, "posix_spawn", _refuse)
    yield


_CACHE_ROOT = tempfile.mkdtemp(prefix="varuna_fx_test_cache_")
_cache_dirs = itertools.count()
os.environ["VARUNA_FX_CACHE_DIR"] = os.path.join(_CACHE_ROOT, "session")  # session fixtures
os.environ.pop("VARUNA_FX_CACHE", None)  # a user's alias must not outlive the isolation above
# the caches' sealing key (world/disk_cache.py), outside every cache folder: never the real home's
_KEY_ROOT = tempfile.mkdtemp(prefix="varuna_fx_test_key_")
os.environ["VARUNA_FX_CACHE_KEY"] = os.path.join(_KEY_ROOT, "cache.key")
os.environ.pop("VARUNA_FX_CACHE_MODE", None)  # whatever the caller's shell has
# one stated machine for every plan (planner/machine.py): the same plans on every host, and no
# test (nor a process it launches) spends a quarter second measuring this one
os.environ["VARUNA_FX_MACHINE"] = os.path.join(os.path.dirname(__file__), "support",
                                               "machine.json")


def _fresh_cache_dir() -> str:
    return os.path.join(_CACHE_ROOT, str(next(_cache_dirs)))


@pytest.fixture(autouse=True, scope="module")
def _own_graph_cache_per_module() -> Iterator[None]:
    """Module fixtures (a checkpoint saved once per module...) run before any test's own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VARUNA_FX_CACHE_DIR", _fresh_cache_dir())
        yield


@pytest.fixture(autouse=True)
def _own_graph_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VARUNA_FX_CACHE_DIR", _fresh_cache_dir())


def pytest_sessionfinish(session: pytest.Session) -> None:
    shutil.rmtree(_CACHE_ROOT, ignore_errors=True)
    shutil.rmtree(_KEY_ROOT, ignore_errors=True)


@pytest.fixture(scope="module")
def one_capture_per_model() -> Iterator[None]:
    """Within a module, capture each (model, example input shapes, tracer, modes) once.

    ``vf.compile`` reuses a capture when the model's key (taken before tracing:
    ``capture/model_key.py``) is unchanged, but every test starts with an empty cache
    directory and a sweep compiles the same unchanged registry model at every P, schedule and
    recompute setting, some under a mode or hook the key does not cover: torch.export's
    capture of a Hugging Face model is about a second each time. Everything after capture still runs per
    compile, and the first compile of each model captures for real. The model is kept in the
    memo so its id cannot be reused by another model."""
    real = varuna_fx.passes.frontend.capture
    memo: dict[tuple, tuple[Any, Any]] = {}

    def capture(model: Any, bound: Any, tracer: str = "auto") -> Any:
        key = (id(model), tracer, tuple(m.training for m in model.modules()),
               tuple((n, tuple(t.shape), t.dtype) for n, t in bound.tensors.items()),
               repr(sorted(bound.constants.items(), key=str)))
        if key not in memo:
            memo[key] = (model, real(model, bound, tracer))
        return memo[key][1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(varuna_fx.passes.frontend, "capture", capture)
        yield


def pytest_configure(config: pytest.Config) -> None:
    try:  # an optional extra: without matplotlib there is no font cache to build
        import matplotlib.font_manager  # noqa: F401  (builds the cache, running fc-list once)
    except ImportError:
        pass


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.freeze()


_cpu: dict[str, float] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    start = time.process_time()
    yield
    if not _is_slow(item):
        _cpu[item.nodeid] = time.process_time() - start


def pytest_terminal_summary(terminalreporter: Any) -> None:
    heavy = sorted(((t, n) for n, t in _cpu.items() if t > FAST_TEST_CPU_LIMIT), reverse=True)
    if heavy:
        terminalreporter.section("fast-tier tests over the CPU limit")
        terminalreporter.line(f"these tests are not marked slow but took more than "
                              f"{FAST_TEST_CPU_LIMIT:.0f} s of CPU each: mark them "
                              "(pytest.param(..., marks=pytest.mark.slow)) or make them cheaper")
        for seconds, nodeid in heavy:
            terminalreporter.line(f"{seconds:6.1f} s  {nodeid}")
