"""Pre-planning the worlds an in-place job may morph to (``morph/preplan.py``): a forked child
searches them into the plan cache on disk, and the morph's re-plan to one of them takes the
search from there: the plan a fresh search makes, with the search skipped."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import varuna_fx as vf
from varuna_fx.api import Replan
from varuna_fx.capture.inputs import bind_inputs
from varuna_fx.codegen.pass_list import CompileState
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.morph.preplan import Preplanner, enabled, next_worlds
from varuna_fx.options import CompileOptions
from varuna_fx.passes.annotate_backward import canonical_names
from varuna_fx.passes.frontend import run_front_end
from varuna_fx.planner import cache as plan_cache
from varuna_fx.runtime.split_backward import input_grads
from varuna_fx.world.where import assumed_world

TOKENS = torch.zeros(2, 16, dtype=torch.long)


def _cluster(gpus: int) -> vf.Cluster:
    return vf.Cluster(gpus=gpus, gpus_per_node=2, gpu_memory="1GiB", flops="1TFLOP/s",
                      inter_node_bandwidth="10Gbit/s")


def _replan() -> Replan:
    """What compile hands an in-place job's pipeline, made in one process."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=3, n_embd=32, n_head=2, block_size=16, vocab_size=256))
    o = CompileOptions(cluster=_cluster(8), loss_fn=lm_loss, global_batch_size=64)
    bound = bind_inputs(model, (TOKENS,))
    state = CompileState(model=model, bound=bound, tracer=o.tracer,
                         canonical=canonical_names(model), profile_split=input_grads)
    run_front_end(state)
    assert state.captured is not None
    return Replan(model, bound, state.canonical, state.captured, o, _cluster(8))


def _plan_for(replan: Replan, world: int) -> tuple:
    with assumed_world(world):
        plan = replan(_cluster(world), 64)[1]
    return (plan.stages, plan.data_parallel, plan.micro_batch_size, plan.schedule.name,
            plan.bounds, plan.predicted_step_time,
            [dataclasses.astuple(a) for a in plan.alternatives])


@pytest.mark.slow  # (it forks a process)
def test_a_preplanned_world_is_searched_once_and_plans_as_a_fresh_search(
        monkeypatch: pytest.MonkeyPatch) -> None:
    replan = _replan()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VARUNA_FX_PLAN_CACHE", "0")
        fresh = {w: _plan_for(replan, w) for w in (6, 3)}
    plan_cache.clear()
    planner = Preplanner(replan)
    assert planner.start(_cluster(8), 64) is not None  # worlds 6, 10 and 7
    assert planner.wait(120), "the pre-planning child did not finish"
    plan_cache.stats.clear()
    assert _plan_for(replan, 6) == fresh[6]
    assert plan_cache.stats["hit"] >= 1 and plan_cache.stats["miss"] == 0  # from its file
    assert _plan_for(replan, 3) == fresh[3]  # a world not pre-planned: searched here
    assert plan_cache.stats["miss"] >= 1
    assert fresh[6][:2] != fresh[3][:2] or fresh[6] != fresh[3]


def test_the_likely_next_worlds_and_who_preplans(monkeypatch: pytest.MonkeyPatch) -> None:
    assert next_worlds(16, 8) == [8, 24, 15]
    assert next_worlds(2, 1) == [1, 3]
    assert next_worlds(1, 8) == [9]
    replan = _replan()
    assert enabled(replan)  # a GPU cluster
    on_cpu = dataclasses.replace(replan, cluster=dataclasses.replace(replan.cluster,
                                                                     device="cpu"))
    assert not enabled(on_cpu)  # the loop needs the cores
    monkeypatch.setenv("VARUNA_FX_PREPLAN", "1")
    assert enabled(on_cpu)
    monkeypatch.setenv("LOCAL_RANK", "1")  # one process per machine
    assert not enabled(replan)
    monkeypatch.setenv("LOCAL_RANK", "0")
    for name, value in (("VARUNA_FX_PREPLAN", "0"), ("VARUNA_FX_PLAN_CACHE", "memory")):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(name, value)
            assert not enabled(replan)
            assert Preplanner(replan).start(_cluster(8), 64) is None
    measured = dataclasses.replace(replan, options=dataclasses.replace(replan.options,
                                                                       profile=True))
    assert not enabled(measured)  # measuring coordinates the ranks: never in a child


@pytest.mark.slow  # (it forks a process)
def test_a_child_still_running_is_ended_by_the_next_morph() -> None:
    planner = Preplanner(_replan())
    pid = planner.start(_cluster(8), 64, worlds=list(range(1, 200)))
    assert pid is not None
    planner.stop()
    assert planner.pid is None
    with pytest.raises(ChildProcessError):  # killed and reaped: nothing left behind
        os.waitpid(pid, 0)
