"""The plan cache (``planner/cache.py``, issue 32 item 2): a compile that saw the same cost
table, cluster and options takes the search's answer from the process or the disk, and the
plan is the one a fresh search makes; anything else searches again."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.planner import cache as plan_cache
from varuna_fx.world.disk_cache import sealed, unsealed
from varuna_fx.world.files import cache_dir

TOKENS = torch.zeros(2, 16, dtype=torch.long)
pytestmark = pytest.mark.usefixtures("one_capture_per_model")  # capture each model once
_MODELS: dict[tuple[int, int], GPT] = {}


def _model(n_embd: int = 32, n_layer: int = 3) -> GPT:
    if (n_embd, n_layer) not in _MODELS:
        with torch.device("meta"):  # planning only: no weights needed
            _MODELS[n_embd, n_layer] = GPT(GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=2,
                                                     block_size=16, vocab_size=256))
    return _MODELS[n_embd, n_layer]


def _cluster(gpus: int = 8, memory: str = "1GiB") -> vf.Cluster:
    return vf.Cluster(gpus=gpus, gpus_per_node=4, gpu_memory=memory, flops="1TFLOP/s",
                      inter_node_bandwidth="10Gbit/s")


def _plan(model: GPT, cluster: vf.Cluster | None = None, **options: object) -> tuple:
    plan = vf.compile(model, cluster or _cluster(), example_inputs=(TOKENS,),
                      loss_fn=lm_loss, **{"global_batch_size": 64, **options}).plan
    return (plan.stages, plan.data_parallel, plan.micro_batch_size, plan.num_micro_batches,
            plan.schedule.name, plan.bounds, plan.predicted_step_time, plan.recompute,
            plan.shard_optimizer, [dataclasses.astuple(a) for a in plan.alternatives],
            [dataclasses.astuple(s) for s in plan.stage_costs])


@pytest.fixture(autouse=True)
def _fresh() -> None:
    plan_cache.clear()
    plan_cache.stats.clear()


def _files() -> list[Path]:
    return sorted((cache_dir("plans")).glob("*.json"))


def test_a_hit_gives_the_plan_a_fresh_search_gives() -> None:
    model = _model()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VARUNA_FX_PLAN_CACHE", "0")
        plain = _plan(model)  # no cache at all
    assert not _files() and plan_cache.stats["write"] == 0
    missed = _plan(model)
    assert plan_cache.stats["miss"] == 1 and plan_cache.stats["write"] == 1 and len(_files()) == 1
    in_memory = _plan(model)
    plan_cache.clear()  # as a restarted process: only the file is left
    from_disk = _plan(model)
    assert plan_cache.stats["hit"] == 2
    assert plain == missed == in_memory == from_disk
    assert plain[0] * plain[1] > 1  # a real search: several devices used


def test_a_changed_model_searches_again() -> None:
    _plan(_model())
    _plan(_model(n_embd=64))  # wider weights
    _plan(_model(n_layer=4))  # one more layer: other code, more operations
    assert plan_cache.stats["hit"] == 0 and plan_cache.stats["miss"] == 3
    assert len(_files()) == 3


def test_a_changed_cluster_or_option_searches_again() -> None:
    model = _model()
    _plan(model)
    _plan(model, _cluster(gpus=4))
    _plan(model, _cluster(memory="512MiB"))
    _plan(model, global_batch_size=32)
    _plan(model, schedule="1f1b")
    _plan(model, recompute=True)
    assert plan_cache.stats["hit"] == 0 and plan_cache.stats["miss"] == 6
    _plan(model, _cluster(gpus=4))  # a world size seen before: its answer is kept
    assert plan_cache.stats["hit"] == 1


@pytest.mark.parametrize("damage", ["truncated", "edited", "another key"])
def test_a_damaged_file_is_ignored_with_a_warning_and_rewritten(damage: str) -> None:
    model = _model()
    fresh = _plan(model)
    (path,) = _files()
    text = path.read_text()
    if damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "edited":  # a plausible plan, but not what was sealed
        path.write_text(text.replace('"stages": ', '"stages": 1', 1))
    else:  # sealed correctly, but for another key (a file copied over another name)
        outer = json.loads(text)
        entry = {**outer["entry"], "key": "0" * 40}
        path.write_text(sealed(entry))
    plan_cache.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _plan(model) == fresh
    said = [str(w.message) for w in caught if issubclass(w.category, plan_cache.PlanCacheWarning)]
    assert len(said) == 1 and str(path) in said[0] and "ignoring the plan cache file" in said[0]
    assert plan_cache.stats["ignored"] == 1 and plan_cache.stats["write"] == 2
    unsealed(path.read_text())  # rewritten whole


def test_memory_only_writes_no_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VARUNA_FX_PLAN_CACHE", "memory")
    model = _model()
    first = _plan(model)
    assert _plan(model) == first and plan_cache.stats["hit"] == 1 and not _files()


def test_the_key_refuses_what_it_cannot_write_down_exactly() -> None:
    class Opaque:  # repr names its address: no value the key could compare
        pass

    assert plan_cache.search_key(1, "a", (2.5,)) == plan_cache.search_key(1, "a", (2.5,))
    assert plan_cache.search_key(1, "a", (2.5,)) != plan_cache.search_key(1, "a", (2.5000001,))
    assert plan_cache.search_key(Opaque()) is None
    assert plan_cache.stats["uncacheable"] == 1


def test_a_refused_search_is_kept_word_for_word() -> None:
    # compile's recompute="auto" plans without recomputation first: where nothing fits that
    # way, a re-plan would pay the refused search every time
    model = _model()
    with pytest.raises(vf.PlanError) as first:
        _plan(model, _cluster(memory="64KiB"))
    assert plan_cache.stats["miss"] >= 1 and plan_cache.stats["hit"] == 0
    misses = plan_cache.stats["miss"]
    plan_cache.clear()  # from the file, as a restarted process
    with pytest.raises(vf.PlanError) as again:
        _plan(model, _cluster(memory="64KiB"))
    assert str(again.value) == str(first.value) and "fits" in str(first.value)
    assert plan_cache.stats["miss"] == misses and plan_cache.stats["hit"] >= 1


def test_a_new_world_reuses_the_prices_of_the_last_and_plans_as_a_fresh_search(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A re-plan for another number of GPUs (a node lost, then back) shares the process's
    memo of priced candidates (``cache.shared_memo``): the same plans, alternatives rows
    included, as searches with nothing shared, and fewer orders made."""
    from varuna_fx.planner import pricing

    model = _model()
    made = [0]
    real = pricing.Pricer._finish

    def counted(self: pricing.Pricer, *args: object, **kw: object) -> float | None:
        made[0] += 1
        return real(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(pricing.Pricer, "_finish", counted)
    worlds = (8, 3, 6)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VARUNA_FX_PLAN_CACHE", "0")
        plain = [_plan(model, _cluster(g)) for g in worlds]
    alone = made[0]
    made[0] = 0
    shared = [_plan(model, _cluster(g)) for g in worlds]
    assert shared == plain
    assert plan_cache.stats["memo shared"] == 2
    assert made[0] < alone, (made[0], alone)
    assert {p[:2] for p in plain} != {plain[0][:2]}  # the worlds plan differently
