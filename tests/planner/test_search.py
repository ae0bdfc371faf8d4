"""Issue 5: the planner's search for P, D and micro-batch size (FLOP-estimated costs)."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest
import torch

import varuna_fx as vf
from varuna_fx.costs.roofline import device_spec
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.passes.assign_stages import CostSetting, partition_problem
from varuna_fx.passes.partition import partition
from varuna_fx.planner import Analyzed, CostTable, Planner, Space, analyze, plan_for
from varuna_fx.schedule import simulate

GB = 64  # global batch of the behaviour tests


@pytest.fixture(scope="module")
def gpt() -> Analyzed:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, n_embd=256, n_head=4, block_size=128, vocab_size=2000))
    return analyze(model, (torch.zeros(4, 128, dtype=torch.long),))


def best(graph: Analyzed, **cluster: object) -> tuple[int, int, int]:
    spec = {"gpus": 32, "gpus_per_node": 8, "flops": "1TFLOP/s", **cluster}
    result = plan_for(graph, vf.Cluster(**spec), global_batch_size=GB)  # type: ignore[arg-type]
    b = result.best
    assert b.stages * b.data_parallel <= 32
    assert b.data_parallel * b.micro_batch_size * b.num_micro_batches == GB
    return b.stages, b.data_parallel, b.micro_batch_size


def test_tiny_model_on_a_fast_network_is_pure_data_parallel(gpt: Analyzed) -> None:
    p, d, _ = best(gpt, inter_node_bandwidth="100GB/s", intra_node_bandwidth="100GB/s")
    assert (p, d) == (1, 32)


@pytest.mark.slow  # three full searches over 32 devices
def test_slower_inter_node_links_prefer_deeper_pipelines_and_fewer_replicas(
        gpt: Analyzed) -> None:
    fast_p, fast_d, _ = best(gpt, inter_node_bandwidth="100GB/s")
    slow_p, slow_d, _ = best(gpt, inter_node_bandwidth="10Gbit/s")
    slower_p, slower_d, _ = best(gpt, inter_node_bandwidth="1Gbit/s")
    assert slow_p > fast_p and slow_d < fast_d
    assert slower_d < fast_d  # (it may also give up pipelining across nodes altogether)


@pytest.mark.slow  # four full searches
def test_less_memory_per_device_prefers_deeper_pipelines(gpt: Analyzed) -> None:
    depths = [best(gpt, inter_node_bandwidth="100GB/s", gpu_memory=m)[0]
              for m in ("16GiB", "100MiB", "50MiB", "30MiB")]
    assert depths == sorted(depths) and depths[-1] > depths[0]


def test_fixed_stages_are_respected_while_d_and_m_are_chosen(gpt: Analyzed) -> None:
    cluster = vf.Cluster(gpus=32, gpus_per_node=8, flops="1TFLOP/s")
    result = plan_for(gpt, cluster, global_batch_size=GB, stages=4)
    assert {a.stages for a in result.alternatives} == {4}
    assert len({(a.data_parallel, a.micro_batch_size) for a in result.alternatives}) > 1
    fixed = plan_for(gpt, cluster, global_batch_size=GB, stages=4, micro_batch_size=2)
    assert {(a.stages, a.micro_batch_size) for a in fixed.alternatives} == {(4, 2)}


def test_nothing_fits_names_the_smallest_memory_that_would(gpt: Analyzed) -> None:
    cluster = vf.Cluster(gpus=8, gpus_per_node=8, gpu_memory="4MiB", flops="1TFLOP/s")
    with pytest.raises(vf.PlanError, match=r"fits in 4.0 MiB .* smallest needs") as info:
        plan_for(gpt, cluster, global_batch_size=16)
    need = float(re.search(r"needs ([0-9.]+) MiB", str(info.value)).group(1))
    roomy = vf.Cluster(gpus=8, gpus_per_node=8, gpu_memory=f"{need * 1.02}MiB",
                       flops="1TFLOP/s")
    assert plan_for(gpt, roomy, global_batch_size=16).best.stages >= 4


def test_impossible_batch_constraints_say_what_to_change(gpt: Analyzed) -> None:
    with pytest.raises(vf.PlanError, match=r"global_batch_size=6 and micro_batch_size=4"):
        plan_for(gpt, vf.Cluster(gpus=4), global_batch_size=6, micro_batch_size=4)
    with pytest.raises(vf.PlanError, match=r"stages=4, data_parallel=2"):
        plan_for(gpt, vf.Cluster(gpus=4), global_batch_size=8, stages=4, data_parallel=2)


@pytest.mark.slow  # searches exhaustively
def test_branch_and_bound_finds_the_exhaustive_optimum(gpt: Analyzed) -> None:
    """Every candidate evaluated in full agrees with the pruned search's top five."""
    cluster = vf.Cluster(gpus=8, gpus_per_node=4, gpu_memory="60MiB", flops="1TFLOP/s",
                         inter_node_bandwidth="5Gbit/s")
    space = Space(8, 4, 32)
    planner = Planner(CostTable.build(gpt.gm), cluster, schedule="varuna", recompute=True)
    fast = planner.search(space, top=5, exact=5)
    full = []
    for c in planner.candidates(space):
        c.schedule = "varuna"
        # partitioned as the search does: each boundary priced at the link it crosses
        c.plan = planner.pricer.plan_candidate(c, 1)
        if c.plan is None:
            continue
        step = planner.pricer.finish(c)  # the full order, memory checked with its own counts
        if step is not None:
            full.append(planner._key(step, c))
    assert fast.partitioned < len(planner.candidates(space)) / 2  # it did prune
    expected = sorted(full)[:5]
    got = [planner._key(c.step_time, c) for c in fast.top]
    assert got == expected
    # by default only the pick is exact; the other rows are upper bounds, never better
    rough = Planner(CostTable.build(gpt.gm), cluster, schedule="varuna", recompute=True)
    picked = rough.search(space, top=5)
    assert rough._key(picked.best.step_time, picked.best) == expected[0]
    assert all(rough._key(c.step_time, c) >= e for c, e in zip(picked.top[1:], expected[1:]))


def test_fast_partition_matches_the_exact_partitioner(gpt: Analyzed) -> None:
    table = CostTable.build(gpt.gm)
    cluster = vf.Cluster(gpus=8, gpus_per_node=8)
    planner = Planner(table, cluster, schedule="varuna", recompute=True)
    bw = planner.pricer.links(2, 1).partition_bandwidth
    for b, cap in ((1, math.inf), (2, math.inf), (2, 40 * 2**20)):
        setting = CostSetting(b, cluster.spec, bw, cap, 3, True)
        # the optimum itself (no trading balance for fewer bytes)
        exact_costs = dataclasses.replace(partition_problem(gpt.gm, setting), byte_tolerance=0.0)
        balancer = planner.pricer.balancer(b)
        for p in (1, 2, 3, 5, 8):
            fast = balancer.partition(p, cap, 3)
            try:
                exact = partition(exact_costs, p)
            except vf.PartitionError:
                assert fast is None
                continue
            assert fast is not None
            busy = fast.forward + fast.recompute + fast.backward
            busy[-1] -= fast.forward[-1]  # the last stage never recomputes
            sends = np.append(fast.send_bytes / bw, 0.0)
            assert max(busy + sends) == pytest.approx(exact.bottleneck, rel=2e-4)


def test_cost_table_agrees_with_partition_problem(gpt: Analyzed) -> None:
    table = CostTable.build(gpt.gm)
    spec = device_spec("a100")
    for b in (1, 3):
        ref = partition_problem(gpt.gm, CostSetting(b, spec, 1e9, math.inf, 1, True))
        units = table.unit_arrays(b, spec)
        busy = units.forward + units.recompute + units.backward
        assert busy.sum() == pytest.approx(ref.compute.sum(), rel=1e-9)
        assert units.weights.sum() == pytest.approx(ref.weight_bytes.sum())
        assert units.activations.sum() == pytest.approx(ref.activation_bytes.sum())
        assert np.allclose(units.cut, ref.cut_bytes[table.units])


def test_cluster_device_type_and_throughput() -> None:
    assert vf.Cluster(gpus=4, device_type="A100").spec.flops == 150e12
    assert vf.Cluster(gpus=4, device_type="h100", flops="100TFLOP/s").spec.flops == 1e14
    assert vf.Cluster(gpus=4).kind == "cuda" and vf.Cluster(gpus=1, device="cpu").kind == "cpu"
    assert vf.Cluster(gpus=4, latency="5us").latency == pytest.approx(5e-6)
    with pytest.raises(vf.VarunaFxError, match="flops="):
        vf.Cluster(gpus=4, device_type="tpu9")
    assert vf.Cluster(gpus=4, device_type="tpu9", flops=1e15).spec.flops == 1e15


def test_faster_devices_predict_faster_steps(gpt: Analyzed) -> None:
    """Roofline: the speed-up lies between the memory-bandwidth and the throughput ratios."""
    times = {}
    for kind in ("v100", "h100"):
        cluster = vf.Cluster(gpus=1, device_type=kind)
        times[kind] = plan_for(gpt, cluster, micro_batch_size=4).best.step_time
    old, new = device_spec("v100"), device_spec("h100")
    speedup = times["v100"] / times["h100"]
    assert new.memory_bandwidth / old.memory_bandwidth * 0.99 <= speedup
    assert speedup <= new.flops / old.flops * 1.01


@pytest.mark.slow  # plans a model afresh through compile
def test_compile_plans_and_shows_the_alternatives() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=64, vocab_size=256, block_size=32))
    tokens = torch.randint(0, 256, (16, 32))
    cluster = vf.Cluster(gpus=8, gpus_per_node=4, gpu_memory="3MiB",
                         inter_node_bandwidth="1Gbit/s", flops="1TFLOP/s")
    pipe = vf.compile(model, cluster, (tokens,), loss_fn=lm_loss, global_batch_size=16)
    plan = pipe.plan
    assert plan.stages > 1 and plan.stages * plan.data_parallel <= 8
    chosen = [a for a in plan.alternatives if a.chosen]
    assert len(chosen) == 1
    assert (chosen[0].stages, chosen[0].data_parallel) == (plan.stages, plan.data_parallel)
    assert "configurations weighed by the planner" in str(plan)
    assert max(chosen[0].stage_memory) <= 3 * 2**20
    # the prediction agrees with a simulation of the plan's own schedule object from the
    # table's per-stage costs (made by another path: codegen.stage_totals, from the stage graphs)
    costs = plan.stage_costs
    sim = simulate(plan.schedule, forward=[s.forward_time for s in costs],
                   backward=[s.backward_time for s in costs],
                   recompute=[s.forward_time for s in costs] if any(plan.recompute) else None,
                   send_bytes=[s.boundary_bytes for s in costs[:-1]],
                   bandwidth=cluster.intra_node_bandwidth)
    assert plan.predicted_step_time == pytest.approx(
        sim.step_time + chosen[0].allreduce_time, rel=0.05)


@pytest.mark.slow  # plans a model afresh
def test_plan_table_and_its_alternatives_row_agree() -> None:
    """One memory model prices the plan: the table's largest stage and the chosen row of the
    alternatives print the same memory (they once said 2.4 and 2.6 MiB for one plan)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=64, vocab_size=256, block_size=32))
    tokens = torch.randint(0, 256, (16, 32))
    cluster = vf.Cluster(gpus=8, gpus_per_node=4, gpu_memory="3MiB",
                         inter_node_bandwidth="1Gbit/s", flops="1TFLOP/s")
    plan = vf.compile(model, cluster, (tokens,), loss_fn=lm_loss, global_batch_size=16).plan
    text = str(plan)
    table, alternatives = text.split("configurations weighed by the planner")
    table = table.split("pipeline boundaries")[0]  # the stage rows, not the boundaries' table
    stage_rows = [line for line in table.splitlines() if re.match(r"^\W+\d+ \W+\d+ ", line)]
    assert len(stage_rows) == plan.stages
    largest = max((float(re.findall(r"([\d.]+) (?:MiB|KiB)", row)[-1]), row)
                  for row in stage_rows)[1]
    chosen_row = next(line for line in alternatives.splitlines() if "*" in line.split()[:2])
    chosen_row = chosen_row.replace(" (ZeRO-1)", "")  # a row that shards marks it after memory
    memory = re.compile(r"[\d.]+ (?:MiB|KiB)")  # (the stage rows end with their sync column)
    assert memory.findall(largest)[-1] == memory.findall(chosen_row)[-1]  # "2.6 MiB" in both
    chosen = next(a for a in plan.alternatives if a.chosen)
    assert [s.memory for s in plan.stage_costs] == pytest.approx(list(chosen.stage_memory))


def test_explicit_stages_on_one_local_device_keep_the_exploration_defaults() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, vocab_size=64, block_size=8))
    tokens = torch.randint(0, 64, (8, 8))
    pipe = vf.compile(model, example_inputs=(tokens,), loss_fn=lm_loss, stages=2)
    assert (pipe.plan.stages, pipe.plan.data_parallel, pipe.plan.num_micro_batches) == (2, 1, 8)
    assert pipe.plan.predicted_step_time and pipe.plan.predicted_step_time > 0
    loss = pipe.step(tokens, target=tokens)
    assert torch.isfinite(torch.as_tensor(loss))


@pytest.mark.slow  # analyses a model afresh (the CLI path)
def test_plan_command_prints_the_choice(capsys: pytest.CaptureFixture[str]) -> None:
    from varuna_fx.launch.cli import main

    code = main(["plan", "--model", "varuna_fx.examples:demo_gpt", "--gpus", "16",
                 "--gpus-per-node", "4", "--global-batch-size", "32", "--device-type", "a100",
                 "--top", "3"])
    out = capsys.readouterr().out
    assert code == 0
    assert "predicted step" in out and "simulated" in out and "stages of the chosen" in out
    assert "decided by:" in out  # what decided the pick (issue 41: plan.explain)


@pytest.mark.slow  # searches and generates cost-aware orders
def test_search_prices_candidates_with_the_order_the_plan_will_run(gpt: Analyzed) -> None:
    """The search simulates each finalist with Varuna's order generated from its own stage and
    link times (what ``price`` gives the plan), not the unit-cost order: on a slow link the
    two differ, and the plan's predicted step must be the one the candidate was chosen by."""
    from varuna_fx.schedule import build_schedule

    cluster = vf.Cluster(gpus=4, gpus_per_node=1, flops="1TFLOP/s",
                         inter_node_bandwidth="200Mbit/s")
    planner = Planner(CostTable.build(gpt.gm), cluster, schedule="varuna", recompute=False)
    result = planner.search(Space(4, 4, 16, stages=4, data_parallel=1), top=3, exact=3)
    differs = False
    for c in result.top:
        costs = planner.pricer.schedule_costs(c)
        own = build_schedule("varuna", c.stages, c.num_micro_batches, False, costs)
        unit, _ = planner.pricer.built(c.stages, c.num_micro_batches)
        differs |= own.per_stage != unit.per_stage
        assert c.step_time == pytest.approx(planner.pricer.simulated(c, own), rel=1e-12)
    assert differs  # the setting is one where the order depends on the costs


@pytest.mark.slow  # a search
def test_split_backward_first_stage_is_all_weight_gradient(gpt: Analyzed) -> None:
    """The first stage has no input gradients to compute (its inputs are the batch): the
    runtime runs its whole backward as W, so the planner's split-backward costs say so; later
    stages split about half and half."""
    from varuna_fx.planner.candidates import weight_grads

    assert weight_grads([4.0, 2.0, 6.0]) == [4.0, 1.0, 3.0]
    assert weight_grads([4.0]) == [2.0]
    cluster = vf.Cluster(gpus=2, gpus_per_node=1, flops="1TFLOP/s",
                         inter_node_bandwidth="1Gbit/s")
    planner = Planner(CostTable.build(gpt.gm), cluster, schedule="varuna-zb", recompute=False)
    c = planner.search(Space(2, 4, 8, stages=2, data_parallel=1), top=1).best
    assert c.plan is not None
    costs = planner.pricer.schedule_costs(c)
    assert costs.w(0) == pytest.approx(float(c.plan.backward[0]))
    assert costs.b(0, split=True) == 0.0
    assert costs.w(1) == pytest.approx(float(c.plan.backward[1]) / 2)
    # the search's prediction is the simulation with exactly these costs
    own = planner.pricer.ordered(c)
    assert c.step_time == pytest.approx(simulate(
        own, forward=list(costs.forward), backward=list(costs.backward),
        recompute=[costs.r(s) for s in range(2)], send_bytes=[costs.link(0)], bandwidth=1.0,
        weight_grad=[costs.w(s) for s in range(2)]).step_time + c.allreduce_time, rel=1e-9)


def test_planning_takes_its_options_whole(gpt: Analyzed) -> None:
    """``Analyzed.plan(PlanOptions)`` is ``plan_for`` (what ``varuna-fx plan`` calls);
    recompute="auto" plans without recomputation where that fits, as compile does."""
    from varuna_fx.planner.options import PlanOptions

    cluster = vf.Cluster(gpus=8, gpus_per_node=8, flops="1TFLOP/s")
    options = PlanOptions(cluster=cluster, global_batch_size=16, stages=4, schedule="varuna",
                          recompute=False, shard_optimizer=False)
    got = gpt.plan(options, top=1).best
    want = plan_for(gpt, cluster, global_batch_size=16, stages=4, schedule="varuna",
                    recompute=False, top=1).best
    row = (got.stages, got.data_parallel, got.micro_batch_size, got.step_time)
    assert row == (want.stages, want.data_parallel, want.micro_batch_size, want.step_time)
    auto = gpt.plan(dataclasses.replace(options, recompute="auto"), top=1).best
    assert auto.step_time == got.step_time
    with pytest.raises(vf.PlanError, match="stages_per_rank=2"):
        gpt.plan(dataclasses.replace(options, stages_per_rank=2))
