"""One memory model prices every stage: the partition pass, the planner and the printed plan
agree to the byte, the model's terms match what the stages really hold, and a memory cap is
checked with the numbers the plan prints."""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any

import numpy as np
import pytest
import torch

import varuna_fx as vf
import varuna_fx.codegen.pass_list as pass_list
from support.registry import CASES
from tiers import tiered
from varuna_fx.costs.memory import WEIGHT_COPIES, MemoryModel, SharedWeight
from varuna_fx.ir.nodes import info
from varuna_fx.passes.assign_stages import compute_nodes, partition_problem
from varuna_fx.passes.partition import PartitionProblem, partition
from varuna_fx.schedule import peak_stash_counts


def _random_model(rng: np.random.Generator, n: int) -> tuple[MemoryModel, dict[str, Any]]:
    parts = {
        "weights": rng.random(n) * (rng.random(n) > 0.3),
        "activations": rng.random(n),
        "cut": np.concatenate([[0.0], rng.random(n - 1), [0.0]]),
        "workspace": rng.random(n),
        "shared": [SharedWeight(float(rng.uniform(1, 3)), 0.0, np.unique(rng.integers(0, n, 3)))
                   for _ in range(2)],
    }
    return MemoryModel(**parts), parts


def _reference(parts: dict[str, Any], i: int, j: int, stash: int, recompute: bool) -> float:
    """The formula written out for one stage [i, j)."""
    held = parts["weights"][i:j].sum()
    for item in parts["shared"]:
        if len(item.nodes) > 1 and item.nodes[0] < i and any(i <= r < j for r in item.nodes):
            held += item.held
    acts = parts["activations"][i:j].sum()
    kept = 1 if recompute else stash
    return float(held + parts["workspace"][i:j].max() + stash * parts["cut"][i] + kept * acts)


@pytest.mark.parametrize("seed", range(6))
def test_model_matches_the_formula_written_out(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 12))
    model, parts = _random_model(rng, n)
    for stash, recompute in itertools.product((1, 3), (False, True)):
        idx = np.arange(n + 1)
        matrix = np.where(idx[:, None] < idx[None, :],
                          model.peak(idx[:, None], idx[None, :], stash, recompute), np.inf)
        for i, j in itertools.combinations(range(n + 1), 2):
            expected = _reference(parts, i, j, stash, recompute)
            assert matrix[i, j] == pytest.approx(expected, rel=1e-12)
            assert float(model.peak(i, j, stash, recompute)) == matrix[i, j]
        assert np.all(np.isinf(matrix[np.tril_indices(n + 1)]))  # no stage [i, j) with j <= i
        # reach: the farthest end that fits, found by the bounds and the exact formula
        for i in range(n):
            for cap in (2.0, 5.0, 9.0, 20.0):
                fits = [j for j in range(i + 1, n + 1) if matrix[i, j] <= cap]
                assert model.reach(i, stash, recompute, cap, n) == (max(fits) if fits else i)
    bounds = [0, n // 2, n] if n > 1 else [0, n]
    per_stage = model.stages(bounds, [2, 1], [True, False])
    assert list(per_stage) == [model.peak(0, n // 2, 2, True), model.peak(n // 2, n, 1, False)]


def _compile(case_name: str, stages: int | None, cluster: vf.Cluster | None = None, **kw: Any
             ) -> tuple[vf.Pipeline, Any]:
    """Compile a registry case and return what the partition pass made and priced."""
    case = CASES[case_name]
    seen: list[Any] = []
    original = pass_list.assign_and_price

    def spy(gm: Any, config: Any, setting: Any) -> Any:
        result = original(gm, config, setting)
        seen.append((gm, setting, *result))
        return result

    pass_list.assign_and_price = spy
    try:
        pipe = vf.compile(case.model, cluster, example_inputs=case.inputs, loss_fn=case.loss_fn,
                          stages=stages, **kw)
    finally:
        pass_list.assign_and_price = original
    return pipe, seen[-1]


@pytest.mark.parametrize(("name", "stages"), tiered(
    [("mlp", 3), ("gpt_tied", 2), ("gpt_tied", 3), ("resnet", 2), ("unet_skips", 3),
     ("albert_shared", 3)], fast=[("gpt_tied", 2), ("albert_shared", 3)]))
def test_partition_pass_planner_and_table_print_the_same_bytes(name: str, stages: int) -> None:
    pipe, (gm, setting, made, priced) = _compile(name, stages)
    plan = pipe.plan
    table = [s.memory for s in plan.stage_costs]
    # the partition pass, the planner's PartitionCosts (``price``) and the table: one set of numbers
    assert made.bounds == plan.bounds
    assert list(made.stage_memory) == pytest.approx(table, rel=1e-12)
    assert list(priced.stage_memory) == pytest.approx(table, rel=1e-12)
    # ...for the stash counts of the schedule that runs: the pass at exactly those counts
    # makes this partition and these bytes
    counts = tuple(peak_stash_counts(plan.schedule))
    again = partition(dataclasses.replace(partition_problem(gm, setting), stash_counts=counts),
                      stages)
    assert again.bounds == plan.bounds and again.recompute == plan.recompute
    assert list(again.stage_memory) == pytest.approx(table, rel=1e-12)
    # the model's terms are what the stages hold: weights (a tied or shared weight on every
    # stage reading it) and the largest single activation of the stage's own operations
    model = partition_problem(gm, setting).memory_model()
    starts, ends = np.array(plan.bounds[:-1]), np.array(plan.bounds[1:])
    holds = []
    for stage in pipe.stages:
        params = list(stage.module.named_parameters())
        holds.append(sum((WEIGHT_COPIES if p.requires_grad else 1) * p.numel() * p.element_size()
                         for _, p in params)
                     + sum(b.numel() * b.element_size() for _, b in stage.module.named_buffers()))
    assert list(model.held(starts, ends)) == holds
    b = plan.micro_batch_size
    nodes = compute_nodes(gm)
    largest = [max(info(x).out_bytes(b) for x in nodes[i:j] if info(x).fwd_flops(b) > 0)
               for i, j in zip(starts, ends)]
    assert list(model.workspace(starts, ends)) == largest


def test_tied_weights_are_held_by_both_stages() -> None:
    """The embedding read again by the head: the last stage holds its own copy, which the
    first-read accounting (the old estimate) left out."""
    pipe, (gm, setting, _, _) = _compile("gpt_tied", 2)
    ((name, holders),) = pipe.plan.tied_parameters.items()
    assert holders == [0, 1]
    weight = dict(pipe.stages[0].module.named_parameters())[name]
    assert any(p is weight for p in pipe.stages[1].module.parameters())  # the same tensor
    copy = WEIGHT_COPIES * weight.numel() * weight.element_size()
    costs = partition_problem(gm, setting)
    bounds = pipe.plan.bounds
    first_read = [costs.weight_bytes[i:j].sum() for i, j in zip(bounds, bounds[1:])]
    held = costs.memory_model().held(np.array(bounds[:-1]), np.array(bounds[1:]))
    assert list(held) == [first_read[0], first_read[1] + copy]


def test_searched_plan_alternatives_row_is_the_partition_pass_memory() -> None:
    torch.manual_seed(0)
    case = CASES["gpt_tied"]
    cluster = vf.Cluster(gpus=4, gpus_per_node=2, gpu_memory="1MiB", device_type="a100")
    pipe, (_, _, made, _) = _compile("gpt_tied", None, cluster,
                                     global_batch_size=case.batch_size)
    chosen = next(a for a in pipe.plan.alternatives if a.chosen)
    assert list(chosen.stage_memory) == pytest.approx(list(made.stage_memory), rel=1e-12)
    assert max(made.stage_memory) <= 2**20


def test_a_cap_the_old_estimate_accepted_moves_the_cut() -> None:
    """Without workspace, the old estimate let the balanced split of the tied GPT into a cap
    its own table then exceeded; now the pass cuts elsewhere and the plan fits as printed."""
    # (one schedule: under "auto" the tight cap is met by another schedule, not another cut)
    roomy, (gm, setting, _, _) = _compile("gpt_tied", 2, recompute=False, schedule="varuna")
    largest = max(s.memory for s in roomy.plan.stage_costs)
    worst = int(np.argmax([s.memory for s in roomy.plan.stage_costs]))
    model = partition_problem(gm, setting).memory_model()
    bounds = np.array(roomy.plan.bounds)
    workspace = float(model.workspace(bounds[:-1], bounds[1:])[worst])
    cap = largest - workspace / 2  # the old estimate (no workspace) of that split fits
    tight = vf.Cluster(gpus=1, gpu_memory=int(cap), device="cpu")
    pipe, (_, _, made, _) = _compile("gpt_tied", 2, tight, recompute=False, schedule="varuna")
    assert pipe.plan.bounds != roomy.plan.bounds
    assert max(s.memory for s in pipe.plan.stage_costs) <= cap
    assert list(made.stage_memory) == pytest.approx([s.memory for s in pipe.plan.stage_costs])


def test_a_cap_the_old_estimate_accepted_is_now_an_error() -> None:
    """ALBERT's one block is read by every stage: each holds a copy. The old estimate counted
    it once, accepted 6000 bytes for 3 stages and printed a plan needing 6.4 KiB."""
    tight = vf.Cluster(gpus=1, gpu_memory=6000, device="cpu")
    with pytest.raises(vf.PartitionError,
                       match=r"no partition into 3 stages fits in 5\.9 KiB per device: the best "
                             r"balanced one needs [\d.]+ KiB on stage \d\. Use more stages"):
        _compile("albert_shared", 3, tight)


def test_shared_copy_decides_the_partition() -> None:
    """A weight read by the first and the last node: any 2-stage split holds it twice, so a
    cap that fits one copy plus the rest (the old estimate) fits no partition."""
    n = 6
    costs = PartitionProblem(np.ones(n), np.array([4.0, 0.5, 0.5, 0.5, 0.5, 0.5]), np.zeros(n),
                           np.zeros(n + 1), memory_cap=5.0,
                           shared=(SharedWeight(4.0, 1.0, np.array([0, n - 1])),))
    assert partition(dataclasses.replace(costs, shared=()), 2).bounds == (0, 3, 6)
    with pytest.raises(vf.PartitionError, match="fits in 5 bytes.*on stage 1"):
        partition(costs, 2)
    roomy = partition(dataclasses.replace(costs, memory_cap=np.inf), 2)
    assert roomy.stage_memory == (5.0, 5.5)  # the copy on the last stage
    assert partition(dataclasses.replace(costs, memory_cap=np.inf), 1).stage_memory == (6.5,)


@pytest.mark.slow
def test_the_memory_the_planner_asks_for_is_what_compile_needs() -> None:
    """When nothing fits, the error names the smallest memory per device; compiling with it
    succeeds (the planner and the partition pass price the same bytes), with less it fails."""
    case = CASES["gpt_tied"]

    def run(memory: str) -> vf.Pipeline:
        return vf.compile(case.model, vf.Cluster(gpus=4, gpu_memory=memory, device_type="a100"),
                          example_inputs=case.inputs, loss_fn=case.loss_fn, global_batch_size=8)

    with pytest.raises(vf.PlanError, match=r"the smallest needs ([\d.]+) KiB") as caught:
        run("100KiB")
    found = re.search(r"needs ([\d.]+) KiB", str(caught.value))
    assert found is not None
    need = float(found.group(1))
    enough = need + 0.1  # the message rounds to 0.1 KiB
    pipe = run(f"{enough}KiB")
    assert max(s.memory for s in pipe.plan.stage_costs) <= enough * 2**10
    with pytest.raises(vf.PlanError, match="fits in"):
        run(f"{need - 1}KiB")
