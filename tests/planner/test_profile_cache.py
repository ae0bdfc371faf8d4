"""Issue 9: the profile cache is a trust boundary, and profiled memory is affine in the batch."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import torch

import varuna_fx.planner.measure as measuring
from varuna_fx.examples import GPT, GPTConfig
from varuna_fx.ir.nodes import Affine
from varuna_fx.passes.assign_stages import compute_nodes
from varuna_fx.planner import analyze
from varuna_fx.planner.cost_table import CostTable
from varuna_fx.planner.measure import ProfileSettings
from varuna_fx.planner.profile import Profile, load_cached, save_cached
from varuna_fx.planner.resolve import resolve_profile
from varuna_fx.world.files import cache_dir

QUICK = ProfileSettings(sizes=(1, 2), repeats=1, warmup=0, max_chunks=2)


COUNTER = {"measurements": 0}


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    import varuna_fx.planner.resolve as resolving

    measure = resolving.measure

    def counted(*args: object, **kw: object) -> object:
        COUNTER["measurements"] += 1
        return measure(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(resolving, "measure", counted)
    monkeypatch.setenv("VARUNA_FX_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=8, vocab_size=64))
    graph = analyze(model, (torch.randint(0, 64, (2, 8)),))
    first = resolve_profile(graph.gm, graph.bound, True, QUICK)
    assert first is not None and not first.from_cache
    return {"graph": graph, "profile": first, "path": cache_dir("profiles") / f"{first.key}.json"}


def reload(tiny: dict) -> Profile | None:
    g = tiny["graph"]
    return resolve_profile(g.gm, g.bound, True, QUICK)


def test_a_good_cache_file_is_used_and_no_temporary_file_stays(tiny: dict) -> None:
    before = COUNTER["measurements"]
    again = reload(tiny)
    assert again is not None and again.from_cache and COUNTER["measurements"] == before
    assert [p.name for p in cache_dir("profiles").iterdir()] == [tiny["path"].name]


def tamper(path: Path, edit: object) -> None:
    data = json.loads(path.read_text())
    edit(data)  # type: ignore[operator]
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("what, edit", [  # each measures again: two in the fast tier
    ("graph", lambda d: d.update(graph="0" * 32)),
    pytest.param("key", lambda d: d.update(key="someone-else"), marks=pytest.mark.slow),
    pytest.param("negative", lambda d: d["chunks"][0]["forward"].update(const=-1.0),
                 marks=pytest.mark.slow),
    ("nan", lambda d: d["chunks"][0]["memory"].update(per_sample=math.nan)),
    pytest.param("negative sample",
                 lambda d: d["chunks"][0]["samples"]["1"].__setitem__(3, -5.0),
                 marks=pytest.mark.slow),
    pytest.param("text", lambda d: d["chunks"][0]["backward"].update(const="fast"),
                 marks=pytest.mark.slow),
    pytest.param("empty", lambda d: d.update(chunks=[]), marks=pytest.mark.slow),
])
def test_a_tampered_cache_file_is_ignored_with_a_warning_and_measured_again(
        tiny: dict, what: str, edit: object) -> None:
    tamper(tiny["path"], edit)
    before = COUNTER["measurements"]
    with pytest.warns(UserWarning, match="ignoring the cached profile"):
        again = reload(tiny)
    assert again is not None and not again.from_cache
    assert COUNTER["measurements"] == before + 1
    assert load_cached(tiny["profile"].key, tiny["profile"].graph) is not None  # rewritten


@pytest.mark.slow  # measures again; the fast tier tampers twice
def test_a_corrupt_cache_file_is_ignored(tiny: dict) -> None:
    tiny["path"].write_text("{not json")
    with pytest.warns(UserWarning, match="cannot be read"):
        assert load_cached(tiny["profile"].key) is None


def test_a_profile_passed_in_with_negative_times_is_refused(tiny: dict) -> None:
    import varuna_fx as vf

    bad = dataclasses.replace(tiny["profile"])
    bad.chunks = [dataclasses.replace(c, forward=Affine(-1.0, 0.0)) for c in bad.chunks]
    g = tiny["graph"]
    with pytest.raises(vf.VarunaFxError, match="negative time or memory"):
        resolve_profile(g.gm, g.bound, bad, QUICK)


@pytest.mark.slow  # measures a fresh profile
def test_saving_leaves_no_temporary_file_when_the_rename_fails(
        tiny: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.warns(UserWarning, match="could not cache"):
        save_cached(tiny["profile"])
    assert [p.name for p in cache_dir("profiles").iterdir()] == [tiny["path"].name]


def test_profiled_memory_is_affine_in_the_batch_on_every_chunk() -> None:
    """The root cause of the flaky fit test: at batch 1 a reshape returns a view of a larger
    storage (q/k/v of one qkv tensor), at larger batches a copy, so counting storage bytes was
    not affine in b and chunks cut inside attention missed the fit by up to ~10%. Cut at every
    possible place, every chunk's memory must now be exactly const + per_sample * b."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=64, n_head=4, block_size=16, vocab_size=64))
    graph = analyze(model, (torch.randint(0, 64, (8, 16)),))
    table = CostTable.build(graph.gm)
    units = sorted({0, *(int(u) for u in table.units), len(compute_nodes(graph.gm))})
    chunks = measuring._build_chunks(graph.gm, units)
    cpu = torch.device("cpu")
    per_size = {}
    for b in (1, 2, 4, 8):
        args = measuring._chunk_args(chunks, measuring._inputs(graph.bound, b, cpu))
        per_size[b] = [measuring._memory(c, a, cpu) for c, a in zip(chunks, args)]
    for k in range(len(chunks)):
        slope = per_size[2][k] - per_size[1][k]
        for b in (4, 8):
            assert per_size[b][k] == per_size[1][k] + slope * (b - 1), (k, per_size)


def test_one_cache_variable_and_the_documented_profiles_alias(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """$VARUNA_FX_CACHE_DIR holds every cache; the old $VARUNA_FX_CACHE (the profiles folder
    itself, as the docs once said) is read for profiles only when the one variable is unset."""
    monkeypatch.setenv("VARUNA_FX_CACHE_DIR", str(tmp_path / "root"))
    monkeypatch.setenv("VARUNA_FX_CACHE", str(tmp_path / "old"))
    assert cache_dir("profiles") == tmp_path / "root" / "profiles"
    assert cache_dir("graphs") == tmp_path / "root" / "graphs"
    monkeypatch.delenv("VARUNA_FX_CACHE_DIR")
    assert cache_dir("profiles") == tmp_path / "old"
    assert cache_dir("graphs") == Path.home() / ".cache" / "varuna_fx" / "graphs"
    monkeypatch.delenv("VARUNA_FX_CACHE")
    assert cache_dir("profiles") == Path.home() / ".cache" / "varuna_fx" / "profiles"
