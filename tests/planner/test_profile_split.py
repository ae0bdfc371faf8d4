"""The profile times the split backward as the runtime runs it, and the planner prices
split-backward schedules with it (input-gradient pass + weight pass, first stage all W)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig
from varuna_fx.planner import CostTable, Planner, Space, analyze
from varuna_fx.planner.measure import ProfileSettings, measure
from varuna_fx.runtime.split_backward import input_grads

pytestmark = pytest.mark.slow  # timing loops (a profile), outside the fast tier

SPLIT = ProfileSettings(sizes=(1, 2), repeats=1, warmup=0, max_chunks=4, min_piece=1e-6,
                        split=input_grads)


@pytest.fixture(scope="module")
def profiled() -> tuple:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=2, vocab_size=128, block_size=16))
    graph = analyze(model, (torch.randint(0, 128, (2, 16)),))
    return graph, measure(graph.gm, graph.bound, "split", SPLIT)


def test_split_passes_are_timed_per_chunk(profiled: tuple) -> None:
    _, profile = profiled
    assert len(profile.chunks) >= 2
    first = profile.chunks[0].samples
    for b in profile.sizes:  # the batch needs no gradient: all of the backward is W
        f, r, bwd, mem, i, w = first[b]
        assert i == 0.0 and w == bwd
    later = [c.samples[b] for c in profile.chunks[1:] for b in profile.sizes]
    assert all(len(s) == 6 and s[4] > 0 and s[5] > 0 for s in later)
    assert ProfileSettings(split=input_grads).key() != ProfileSettings().key()


def test_planner_prices_split_schedules_with_the_measured_passes(profiled: tuple) -> None:
    graph, profile = profiled
    table = CostTable.build(graph.gm)
    table.measured = profile.measured_times(table)
    arrays = table.measured.arrays(2)
    assert arrays.input_grad is not None and arrays.weight_grad is not None
    cluster = vf.Cluster(gpus=2, gpus_per_node=1, inter_node_bandwidth="1Gbit/s")
    planner = Planner(table, cluster, schedule="varuna-zb", recompute=False)
    c = planner.search(Space(2, 2, 4, stages=2, data_parallel=1, micro_batch_size=2),
                       top=1).best
    plan = c.plan
    assert plan is not None and plan.input_grad is not None and plan.weight_grad is not None
    backward, weight = planner.pricer.backward_costs(plan)
    assert backward[0] == weight[0] == pytest.approx(float(plan.backward[0]))
    assert backward[1] == pytest.approx(float(plan.input_grad[1] + plan.weight_grad[1]))
    assert weight[1] == pytest.approx(float(plan.weight_grad[1]))
    # a schedule that does not split keeps the fused backward
    fused = Planner(table, cluster, schedule="varuna", recompute=False).pricer \
        .backward_costs(plan)[0]
    assert fused == pytest.approx(np.asarray(plan.backward, float).tolist())
