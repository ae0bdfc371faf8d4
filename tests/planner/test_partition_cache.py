"""The partition pass's answer kept beside the search's (planner/partition_cache.py): a hit gives
the plan a fresh partition gives, without partitioning; a configuration not searched keeps
nothing; a damaged file is ignored; a pre-plan leaves the partition for the morph's re-plan.
(tests/conftest.py gives every test its own empty cache directory.)"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import varuna_fx as vf
from varuna_fx import api
from varuna_fx.capture.inputs import bind_inputs
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.options import CompileOptions
from varuna_fx.passes.annotate_backward import canonical_names
from varuna_fx.planner import cache as plan_cache
from varuna_fx.planner import configure, partition_cache
from varuna_fx.world.disk_cache import sealed
from varuna_fx.world.files import cache_dir
from varuna_fx.world.where import assumed_world

TOKENS = torch.zeros(2, 16, dtype=torch.long)


def _model() -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(n_layer=3, n_embd=32, n_head=2, block_size=16, vocab_size=256))


def _cluster(gpus: int = 8) -> vf.Cluster:
    return vf.Cluster(gpus=gpus, gpus_per_node=4, gpu_memory="1GiB", flops="1TFLOP/s",
                      inter_node_bandwidth="10Gbit/s")


def _plan(model: GPT, gpus: int = 8, **options: object) -> tuple:
    with assumed_world(gpus):  # as a launched job plans: P x D is the world
        pipe = vf.compile(model, _cluster(gpus), example_inputs=(TOKENS,), loss_fn=lm_loss,
                          **{"global_batch_size": 64, **options})
    plan = pipe.plan
    return (plan.stages, plan.data_parallel, plan.micro_batch_size, plan.schedule.name,
            plan.bounds, plan.predicted_step_time, plan.recompute,
            [dataclasses.astuple(a) for a in plan.alternatives],
            [dataclasses.astuple(s) for s in plan.stage_costs], [s.code for s in pipe.stages])


def _restart() -> None:
    """Forget what the process keeps: only the files are left."""
    plan_cache.clear()
    partition_cache.clear()


@pytest.fixture(autouse=True)
def _fresh() -> None:
    _restart()
    partition_cache.stats.clear()


def _files() -> list[Path]:
    return sorted(cache_dir("partitions").glob("*.json"))


def test_a_hit_gives_the_plan_a_fresh_partition_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    with monkeypatch.context() as patch:
        patch.setenv("VARUNA_FX_PLAN_CACHE", "0")
        plain = _plan(model)
    assert not _files() and partition_cache.stats["write"] == 0
    missed = _plan(model)
    assert partition_cache.stats["miss"] == 1 and len(_files()) == 1
    monkeypatch.setattr(configure, "partition", lambda *a: pytest.fail("partitioned again"))
    in_memory = _plan(model)
    _restart()
    from_disk = _plan(model)
    assert partition_cache.stats["hit"] == 2
    assert plain == missed == in_memory == from_disk
    assert plain[0] > 1  # a real partition: several stages


def test_a_configuration_not_searched_keeps_nothing() -> None:
    _plan(_model(), gpus=1, stages=2)  # one process, P given: no search, no key
    assert not _files() and partition_cache.stats["miss"] == 0


@pytest.mark.parametrize("damage", ["truncated", "edited", "impossible"])
def test_a_damaged_file_is_ignored_and_rewritten(damage: str) -> None:
    model = _model()
    fresh = _plan(model)
    (path,) = _files()
    text = path.read_text()
    if damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "edited":  # other bounds, not what was sealed
        path.write_text(text.replace('"bounds": [0, ', '"bounds": [0, 1, ', 1))
    else:  # sealed, but bounds that cannot be a partition
        entry = json.loads(text)["entry"]
        entry["partition"]["bounds"] = [0, 5, 3]
        path.write_text(sealed(entry))
    _restart()
    assert _plan(model) == fresh
    assert partition_cache.stats["ignored"] == 1 and partition_cache.stats["write"] == 2


def test_a_pre_plan_leaves_the_partition_for_the_morph(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    first = vf.compile(model, _cluster(8), example_inputs=(TOKENS,), loss_fn=lm_loss,
                       global_batch_size=64)
    options = CompileOptions(cluster=_cluster(8), loss_fn=lm_loss, global_batch_size=64)
    replan = api.Replan(model, bind_inputs(model, (TOKENS,)), canonical_names(model),
                        first.captured, options, _cluster(8))
    written = partition_cache.stats["write"]
    with assumed_world(4):
        replan.search(_cluster(4), 64)  # what the pre-planner's child runs
    assert partition_cache.stats["write"] == written + 1
    _restart()
    monkeypatch.setattr(configure, "partition", lambda *a: pytest.fail("partitioned again"))
    with assumed_world(4):
        stages, plan, _ = replan(_cluster(4), 64)
    assert partition_cache.stats["hit"] == 1 and plan.stages * plan.data_parallel == 4
