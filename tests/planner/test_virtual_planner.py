"""The planner and virtual stages: links and reductions per rank, and weighing v on the link."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.planner import Analyzed, Planner, Space, analyze
from varuna_fx.planner.balance import PartitionCosts
from varuna_fx.planner.network import Links, rank_allreduce, rank_links
from varuna_fx.planner.virtual import weigh
from varuna_fx.schedule import build_schedule, simulate


@pytest.fixture(scope="module")
def gpt() -> Analyzed:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, n_embd=256, n_head=4, block_size=64, vocab_size=2048))
    return analyze(model, (torch.zeros(16, 64, dtype=torch.long),))


def _links(bandwidths: list[float]) -> Links:
    return Links(bandwidths, 0.0, min(bandwidths), 1.0, 0.0)


def test_rank_links_follow_the_placement() -> None:
    net = _links([1.0, 2.0, 3.0])  # 4 ranks
    v = rank_links(net, build_schedule("zbv", 8, 8, False))  # ranks 0 1 2 3 3 2 1 0
    assert v.bandwidths == [1.0, 2.0, 3.0, math.inf, 3.0, 2.0, 1.0]
    looped = rank_links(net, build_schedule("interleaved-1f1b", 8, 8, False))
    assert looped.bandwidths == [1.0, 2.0, 3.0, 1.0, 1.0, 2.0, 3.0]  # 3 -> 0: slowest between


def _plan(grads: list[float], shared: tuple = ()) -> PartitionCosts:
    z = np.zeros(len(grads))
    return PartitionCosts(tuple(range(len(grads) + 1)), z, z, z, z[:-1], z, z, np.asarray(grads),
                     0.0, z, z, shared_holders=shared)


def test_rank_allreduce_sums_a_ranks_stages_and_skips_tied_copies_on_one_rank() -> None:
    net = Links([1.0], 0.0, 1.0, 1.0, 0.0)  # all-reduce: 1 byte/s, no latency
    tied = ((10.0, (0, 3)),)  # an embedding and head of 10 bytes on stages 0 and 3
    plan = _plan([40.0, 20.0, 20.0, 30.0], tied)
    zbv, looped = build_schedule("zbv", 4, 4, False), build_schedule("interleaved-1f1b", 4, 4,
                                                                     False)
    # D = 2: ring factor 2 (D-1)/D = 1. V shape: rank 0 holds 0 and 3 (one tied tensor)
    assert rank_allreduce(net, plan, zbv, 2) == pytest.approx(40 + 30 - 10)
    # looped: rank 0 holds 0 and 2, rank 1 holds 1 and 3; the tied pair crosses ranks
    assert rank_allreduce(net, plan, looped, 2) == pytest.approx(60 + 10)
    assert rank_allreduce(net, plan, zbv, 1) == 0.0  # one replica, tied sum local
    assert rank_allreduce(net, plan, looped, 1) == pytest.approx(10)


def test_a_pricer_is_fixed_when_made_and_v_stages_per_rank_is_another_pricer(
        gpt: Analyzed) -> None:
    """Nothing writes a pricer's setting (configure once set v and the memory cap on the
    planner from outside): v stages per rank is a pricer of its own, with its own memo."""
    pricer = Planner(gpt.table(), vf.Cluster(gpus=4, gpu_memory="1GiB"),
                     schedule="interleaved-1f1b",
                     recompute=False).pricer
    with pytest.raises(dataclasses.FrozenInstanceError):
        pricer.memory_cap = 1.0  # type: ignore[misc]
    three = pricer.per_rank(3)
    assert (three.memory_cap, three.stages_per_rank) == (2**30 / 3, 3)
    assert (pricer.memory_cap, pricer.stages_per_rank) == (2**30, None)
    assert three.per_rank(3) is three and three.memo is not pricer.memo
    assert three.built(6, 6)[0].stages_per_rank == 3
    assert pricer.built(6, 6)[0].stages_per_rank == 2  # the schedule's default


def _weighed(gpt: Analyzed, gbits: float) -> tuple[float, dict[str, float]]:
    cluster = vf.Cluster(gpus=2, gpus_per_node=1, inter_node_bandwidth=gbits * 1e9 / 8,
                         flops="10TFLOP/s", gpu_memory=2**34)
    planner = Planner(gpt.table(), cluster, schedule="1f1b", recompute=False)
    best = planner.search(Space(2, 16, 16, stages=2, data_parallel=1, micro_batch_size=4)).best
    return best.step_time, {c.schedule: c.step_time for c, _ in weigh(planner.pricer, best)}


def test_the_link_decides_whether_virtual_stages_pay(gpt: Analyzed) -> None:
    """Fast link: two stages per rank shrink 1F1B's bubble. Slow link: the looped placement's
    traffic (a message across every boundary, about v times 1F1B's bytes) costs more than the
    bubble saves; the V shape sends about twice 1F1B's but keeps more micro-batches in flight,
    which on a link-bound pipeline (P = 2, m = 4: 1F1B waits a round trip per micro-batch)
    hides the wire better."""
    fast, virtual = _weighed(gpt, 1000.0)
    assert virtual["interleaved-1f1b"] < fast and virtual["zbv"] < fast
    assert virtual["dualpipev"] < fast
    slow, virtual_slow = _weighed(gpt, 0.1)
    assert virtual_slow["interleaved-1f1b"] > 1.4 * slow
    assert virtual_slow["zbv"] < virtual_slow["interleaved-1f1b"]
    # per link, looped pays more for a slower link than the V shape
    assert virtual_slow["interleaved-1f1b"] / virtual["interleaved-1f1b"] > \
        virtual_slow["zbv"] / virtual["zbv"]


@pytest.mark.parametrize("gbits", [0.1, 1000.0])
def test_a_free_choice_takes_the_fastest(gbits: float) -> None:
    """compile(stages_per_rank=None, schedule="auto"): virtual schedules are weighed on the
    chosen ranks; the pick is one only where it simulated faster, and it runs equal to eager."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=64, n_head=2, block_size=16, vocab_size=256))
    tokens = torch.randint(0, 256, (16, 17))
    cluster = vf.Cluster(gpus=2, gpus_per_node=1, inter_node_bandwidth=gbits * 1e9 / 8,
                         flops="10TFLOP/s", gpu_memory=2**34)
    pipe = vf.compile(model, cluster, example_inputs=(tokens[:, :-1],), loss_fn=lm_loss,
                      global_batch_size=16, data_parallel=1, micro_batch_size=4,
                      stages=None, schedule="auto",
                      stages_per_rank=None)
    plan = pipe.plan
    if gbits == 1000.0:
        assert plan.stages_per_rank == 2 and plan.schedule.is_virtual
        assert plan.placement is not None and plan.placement.world_size == 2
        # both weighed (listed as rows) on the chosen two ranks
        assert {"interleaved-1f1b", "zbv", "dualpipev"} <= {a.schedule
                                                           for a in plan.alternatives}
    else:  # the looped placement's traffic never wins on the slow link
        assert plan.schedule.name != "interleaved-1f1b"
    loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = pipe.step(tokens[:, :-1], target=tokens[:, 1:])
    torch.testing.assert_close(got, loss.detach())
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, expected[n])


def test_dualpipev_is_priced_with_its_own_stash_and_order(gpt: Analyzed) -> None:
    """Weighed among the virtual choices, DualPipeV's candidate is partitioned for the stash
    counts its order holds (the simulator's: rank r's first chunk 2R-r micro-batches, its
    second r+1), its memory priced from them and its step the simulation of its own order."""
    cluster = vf.Cluster(gpus=2, gpus_per_node=1, inter_node_bandwidth=1e9 / 8,
                         flops="10TFLOP/s", gpu_memory=2**34)
    planner = Planner(gpt.table(), cluster, schedule="1f1b", recompute=False)
    best = planner.search(Space(2, 16, 16, stages=2, data_parallel=1, micro_batch_size=4)).best
    found = {c.schedule: (c, sched) for c, sched in weigh(planner.pricer, best)}
    c, sched = found["dualpipev"]
    assert sched.name == "dualpipev" and sched.stage_ranks == (0, 1, 1, 0)
    sim = simulate(sched, [1.0] * 4, [2.0] * 4)
    assert c.stash_counts == tuple(sim.peak_stash_count) == (4, 3, 2, 1)
    assert c.memory == tuple(float(x) for x in c.plan.memory(list(c.stash_counts), False))
    # ZB-V: the same placement and stash (so the same partition), another order, priced
    # apart; DualPipeV's order on ZB-V's candidate is DualPipeV's price
    z, zbv = found["zbv"]
    assert zbv.stage_ranks == sched.stage_ranks and zbv.lists != sched.lists
    assert z.stash_counts == c.stash_counts and z.memory == c.memory
    assert planner.pricer.simulated(copy.copy(z), sched) == pytest.approx(c.step_time)
    assert c.step_time != pytest.approx(z.step_time)


def test_compile_with_dualpipev_plans_its_ranks_and_runs_as_eager() -> None:
    """schedule="dualpipev" with the stages left to the planner: two stages per rank on the
    cluster's ranks, the step equal to eager."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=32, n_head=2, block_size=8, vocab_size=64))
    tokens = torch.randint(0, 64, (8, 9))
    pipe = vf.compile(model, vf.Cluster(gpus=2, device="cpu"), example_inputs=(tokens[:, :-1],),
                      loss_fn=lm_loss, global_batch_size=8, data_parallel=1,
                      schedule="dualpipev", stages_per_rank=None)
    plan = pipe.plan
    assert plan.schedule.name == "dualpipev" and plan.stages_per_rank == 2
    assert plan.stages == 4 and plan.placement.world_size == 2
    loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = pipe.step(tokens[:, :-1], target=tokens[:, 1:])
    torch.testing.assert_close(got, loss.detach())
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, expected[n])
