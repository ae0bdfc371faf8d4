"""The planner's slow-link bounds hold, and a memory-tight search on a slow link stays exact.

A link carries one message at a time each way, so a step lasts at least one micro-batch's
round trip plus ``m - 1`` messages queued on the slowest link (``floors.link_queue``; with
the partition's own cuts where no order can make the search re-partition it,
``floors.plan_queue``). That bound took a memory-tight search on a 1 Gbit/s link from
minutes to seconds; here it is checked against the simulator on random settings, the planner's
bounds against the steps it then simulates, and a whole search against evaluating every
candidate.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

import varuna_fx as vf
import varuna_fx.planner.floors as floors
from tiers import tiered
from varuna_fx.examples import GPT, GPTConfig
from varuna_fx.planner import Analyzed, CostTable, Planner, Space, analyze
from varuna_fx.planner.candidates import Candidate
from varuna_fx.planner.pricing import Pricer
from varuna_fx.schedule import (
    ScheduleCosts,
    build_schedule,
    clear_caches,
    depends_on_costs,
    is_split,
    peak_stash_counts,
    schedule_names,
    simulate,
)


def test_a_step_lasts_a_round_trip_plus_the_slowest_links_queue() -> None:
    """The proof of ``floors.link_queue`` against ``simulate``, every schedule, random costs."""
    rng = random.Random(5)
    for _ in range(150):
        p, m = rng.randint(2, 6), rng.randint(1, 12)
        name = rng.choice(schedule_names())
        rc = [rng.random() < 0.6 for _ in range(p)]
        forward = [rng.uniform(0.1, 2) for _ in range(p)]
        recompute = [rng.uniform(0.1, 2) for _ in range(p)]
        backward = [rng.uniform(0.2, 4) for _ in range(p)]
        weight = [rng.uniform(0, 1) * b for b in backward]
        sizes = [rng.choice([1.0, rng.uniform(0, 9)]) for _ in range(p - 1)]
        bandwidth = [rng.choice([1.0, 50.0, rng.uniform(0.2, 5)]) for _ in range(p - 1)]
        latency = rng.choice([0.0, 0.3])
        links = [latency + s / b for s, b in zip(sizes, bandwidth)]
        sched = build_schedule(name, p, m, rc, ScheduleCosts.of(
            forward, backward, recompute=recompute, links=links, weight_grad=weight))
        step = simulate(sched, forward=forward, backward=backward, recompute=recompute,
                        send_bytes=sizes, latency=latency, bandwidth=bandwidth,
                        weight_grad=weight).step_time
        # the forward each stage runs (a recomputing stage's first pass keeps no graph, as
        # PartitionCosts.sim_forward: the simulator is given that one), the part of the backward
        # the stage upstream waits for
        chain = [b - w for b, w in zip(backward, weight)] if is_split(name) else backward
        trip = sum(forward) + sum(chain) + 2 * sum(links)
        wire = max(s / b for s, b in zip(sizes, bandwidth))
        # (summed in another order: the same value to the last bits)
        assert step >= (trip + (m - 1) * wire) * (1 - 1e-12), (name, p, m)


def test_varuna_orders_hold_one_micro_batch_on_the_last_stage() -> None:
    """What ``floors.most_held`` relies on: B goes before F, and the last stage's B is ready as its
    F ends; no stage holds more than m."""
    rng = random.Random(8)
    for _ in range(40):
        p, m = rng.randint(2, 7), rng.randint(1, 16)
        rc = [rng.random() < 0.7 for _ in range(p)]
        costs = ScheduleCosts.of(
            [rng.uniform(0.2, 2) for _ in range(p)], [rng.uniform(0.5, 4) for _ in range(p)],
            recompute=[rng.uniform(0.2, 2) for _ in range(p)],
            links=[rng.choice([0.0, rng.uniform(0, 6)]) for _ in range(p - 1)])
        for effort in ("rough", "quick", "full"):
            counts = peak_stash_counts(build_schedule("varuna", p, m, rc, costs, effort=effort))
            assert counts[-1] == 1 and max(counts) <= m, (p, m, effort, counts)


@pytest.fixture(scope="module")
def gpt() -> Analyzed:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=6, n_embd=128, n_head=4, block_size=64, vocab_size=1000))
    return analyze(model, (torch.zeros(4, 64, dtype=torch.long),))


# memory-tight (some candidates are re-partitioned for their orders, some do not fit at all)
# on slow links, and one roomy fast cluster
SLOW = [
    dict(gpus=16, gpus_per_node=4, flops="1TFLOP/s", inter_node_bandwidth="1Gbit/s",
         gpu_memory="24MiB"),
    dict(gpus=16, gpus_per_node=2, flops="1TFLOP/s", inter_node_bandwidth="200Mbit/s",
         gpu_memory="40MiB", latency="50us"),
    dict(gpus=8, gpus_per_node=8, flops="5TFLOP/s"),
]


@pytest.mark.parametrize("spec, schedule", tiered(
    [(k, s) for k in range(len(SLOW)) for s in ("varuna", "auto")],
    [(0, "varuna")]))
def test_bounds_never_exceed_the_step_the_search_then_simulates(
        gpt: Analyzed, spec: int, schedule: str) -> None:
    """For every candidate: the first bound (any partition) and the link queue (any
    partition) are below its full step; the partition's own floor where ``is_final`` says no
    order re-partitions it, and then none does. (Where one does, the first partition's own
    cuts can bound above the step of the second: that is why ``is_final`` is asked.)"""
    clear_caches()
    planner = Planner(CostTable.build(gpt.gm), vf.Cluster(**SLOW[spec]),  # type: ignore[arg-type]
                      schedule=schedule, recompute=True)
    pricer = planner.pricer
    pool = planner.candidates(Space(pricer.cluster.gpus, 4, 64))
    finals = checked = needed = 0
    for first, c in zip(floors.all_from_totals(pricer, pool), pool):
        c.plan = pricer.partition(c.micro_batch_size, c.stages, None)
        if c.plan is None:
            continue
        for one in planner._branches(c):
            final = floors.is_final(pricer, one)
            own = floors.from_stages(pricer, one)
            assumed = floors.from_stages(pricer, one, final=True)
            plan = one.plan
            step = pricer.finish(one)
            if step is None:
                continue
            checked += 1
            key = planner._key(step, one)
            assert planner._key(first, one) <= key
            # (summed in another order: the same value to the last bits)
            assert floors.link_queue(pricer, one) + pricer.allreduce(one) <= step * (1 + 1e-12)
            if final:
                finals += 1
                assert one.plan is plan  # not re-partitioned
                assert planner._key(own, one) <= key
            else:
                needed += assumed > step * (1 + 1e-9)
    assert checked > 20 and finals > 5
    if spec == 0:
        assert needed > 0


def _exhaustive(planner: Planner, space: Space, top: int) -> list[tuple[object, ...]]:
    """Every candidate (and schedule) partitioned as the search would and simulated with its
    full order, memory checked with that order's own counts: the keys of the fastest."""
    found = []
    pricer = planner.pricer
    for c in planner.candidates(space):
        c.plan = pricer.partition(c.micro_batch_size, c.stages, None)
        if c.plan is None:
            continue
        for one in planner._branches(c):
            if one.stages == 1 or not depends_on_costs(one.schedule):  # as level 1 does
                _, counts = pricer.built(one.stages, one.num_micro_batches, one.schedule)
                if not pricer.fits(one, counts) and not pricer.fit(one, counts):
                    continue
            step = pricer.finish(one)
            if step is not None:
                found.append(planner._key(step, one))
    return sorted(found)[:top]


@pytest.mark.parametrize("schedule", tiered(["varuna", "auto"], ["varuna"]))
def test_memory_tight_slow_link_search_picks_what_evaluating_everything_picks(
        gpt: Analyzed, schedule: str) -> None:
    """A memory-tight search on 1 Gbit/s links (where the link queue prunes most
    candidates) ranks its exact rows as evaluating every candidate in full does; the listed
    rows are estimates of orders the runtime could run, never better than the full ones."""
    spec = SLOW[0]
    space = Space(16, 4, 64)
    table = CostTable.build(gpt.gm)
    clear_caches()
    fast = Planner(table, vf.Cluster(**spec), schedule=schedule,  # type: ignore[arg-type]
                   recompute=True)
    result = fast.search(space, top=4, exact=2)
    clear_caches()
    full = _exhaustive(Planner(table, vf.Cluster(**spec),  # type: ignore[arg-type]
                               schedule=schedule, recompute=True), space, 4)
    got = [fast._key(c.step_time, c) for c in result.top]
    assert got[:2] == full[:2]
    assert all(g >= f for g, f in zip(got[2:], full[2:]))
    assert result.partitioned < len(fast.candidates(space)) / 2  # it did prune


def test_a_search_without_the_link_bounds_lists_the_same_rows(
        gpt: Analyzed, monkeypatch: pytest.MonkeyPatch) -> None:
    """The link queue only prunes: with it switched off (the round trip alone, no
    partition's own queue) the pick, its step and the listed rows are the same bits."""
    def search() -> tuple[list[tuple[object, ...]], tuple[int, ...]]:
        clear_caches()
        planner = Planner(CostTable.build(gpt.gm), vf.Cluster(**SLOW[1]),  # type: ignore[arg-type]
                          schedule="varuna", recompute=True)
        result = planner.search(Space(16, 4, 64), top=6)
        return [dataclasses.astuple(a) for a in result.alternatives], result.best.plan.bounds

    bounded = search()

    def round_trip(pricer: Pricer, c: Candidate) -> float:
        split = floors.split_schedule(pricer, c) is not None
        chain = floors.totals_at(pricer, c.micro_batch_size, split)[3]
        return chain + floors.hops(pricer, c.micro_batch_size, c.stages, c.data_parallel)

    monkeypatch.setattr(floors, "link_queue", round_trip)
    monkeypatch.setattr(floors, "plan_queue", lambda pricer, c, hop, back, final=False: 0.0)
    monkeypatch.setattr(floors, "all_from_totals",
                        lambda pricer, pool: [floors.from_totals(pricer, c) for c in pool])
    assert search() == bounded
    assert np.isfinite(bounded[0][0][4])
