"""The planner's fast paths give the very bits the plain ones do.

The search got faster by timing each per-candidate order once without compiling it
(``simulate_step``), by remembering Varuna's orders per rule variant, by finding where a stage
stops fitting once per (stash count, memory cap) instead of per bisection step, and by
computing the first floors (lower bounds) of all candidates at once. None of them may change a chosen
configuration, a predicted step or an alternatives row: each is compared here, float for
float, with the path it replaced, and a whole search with every fast path against one with
all of them switched off.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import numpy as np
import pytest
import torch

import varuna_fx as vf
import varuna_fx.planner.floors as floors
import varuna_fx.planner.pricing as pricing_module
from tiers import tiered
from varuna_fx.costs.memory import SharedWeight
from varuna_fx.errors import ScheduleError
from varuna_fx.examples import GPT, GPTConfig
from varuna_fx.planner import Analyzed, CostTable, Planner, Space, analyze
from varuna_fx.planner.balance import Balancer
from varuna_fx.planner.cost_table import UnitArrays
from varuna_fx.planner.pricing import Pricer, order_stash_floor
from varuna_fx.schedule import (
    Action,
    Kind,
    Schedule,
    ScheduleCosts,
    build_schedule,
    clear_caches,
    peak_stash_counts,
    schedule_names,
    schedule_spec,
    simulate,
    simulate_costs,
    simulate_costs_step,
    simulate_step,
)
from varuna_fx.schedule import varuna as varuna_module
from varuna_fx.schedule.varuna import QUICK_VARIANTS, ROUGH_VARIANTS, fastest, varuna_order


def _random_costs(rng: random.Random, p: int) -> ScheduleCosts:
    return ScheduleCosts.of(
        [rng.uniform(0.5, 2) for _ in range(p)], [rng.uniform(1, 4) for _ in range(p)],
        recompute=[rng.uniform(0.5, 2) for _ in range(p)],
        weight_grad=[rng.uniform(0, 2) for _ in range(p)],
        links=[rng.choice([0.0, rng.uniform(0, 3)]) for _ in range(p - 1)])


def test_simulate_step_times_every_schedule_as_simulate_does() -> None:
    rng = random.Random(11)
    for _ in range(60):
        p, m = rng.randint(1, 6), rng.randint(1, 9)
        name = rng.choice(schedule_names())
        rc = [rng.random() < 0.6 for _ in range(p)]
        sched = build_schedule(name, p, m, rc, _random_costs(rng, p))
        args: dict[str, Any] = dict(
            forward=[rng.uniform(0.5, 2) for _ in range(p)],
            backward=[rng.uniform(1, 4) for _ in range(p)],
            recompute=rng.choice([None, [rng.uniform(0.5, 2) for _ in range(p)]]),
            send_bytes=rng.choice([None, [rng.choice([0.0, rng.uniform(0, 9)])
                                          for _ in range(p - 1)]]),
            latency=rng.choice([0.0, 0.25]),
            bandwidth=rng.choice([math.inf, 3.0, [rng.uniform(1, 4) for _ in range(p - 1)]]),
            weight_grad=rng.choice([None, [rng.uniform(0, 1) for _ in range(p)]]),
        )
        full, once = simulate(sched, **args), simulate_step(sched, **args)
        assert (once.step_time, once.bubble_fraction) == \
            (full.step_time, full.bubble_fraction), (name, p, m)
        costs = _random_costs(rng, p)
        full, once = simulate_costs(sched, costs), simulate_costs_step(sched, costs)
        assert (once.step_time, once.bubble_fraction) == (full.step_time, full.bubble_fraction)


def _stages(text: str) -> list[list[Action]]:
    return [[Action.parse(a) for a in line.split()] for line in text.split("|")]


@pytest.mark.parametrize("lists, recompute, split", [
    ("0F0 0B0 | 1F0 1B0 1B0", False, False),  # twice
    ("0F0 0B0 | 1F0", False, False),  # missing
    ("0F0 0B0 | 1B0 1F0", False, False),  # B before its F
    ("0F0 0B0 | 1F0 1R0 1B0", False, False),  # the last stage recomputes
    ("0F0 0B0 | 1F0 1B0", True, False),  # R missing on a recomputing stage
    ("0F0 0B0 0W0 | 1F0 1B0", False, False),  # W without split backward
    ("0F0 0B0 | 1F0 1B0 1W0", False, True),  # W missing on stage 0
    ("0F0 1B0 | 1F0 1B0", False, False),  # another stage's action
    ("0F0 0B0 0F1 | 1F0 1B0", False, False),  # micro-batch out of range
    ("0F0 0B0 0F1 0B1 | 1F0 1F1 1B0 1B1", False, False),  # deadlock (m=2)
])
def test_simulate_step_rejects_what_simulate_rejects(lists: str, recompute: bool,
                                                     split: bool) -> None:
    per_stage = _stages(lists)
    m = 2 if "1B1" in lists and "0F1 0B1" in lists else 1
    sched = Schedule("test", 2, m, recompute, per_stage, split_backward=split)
    with pytest.raises(ScheduleError) as full:
        simulate(sched, forward=[1.0, 1.0], backward=[2.0, 2.0])
    with pytest.raises(ScheduleError) as once:
        simulate_step(sched, forward=[1.0, 1.0], backward=[2.0, 2.0])
    assert str(once.value) == str(full.value)


def test_varuna_orders_remembered_per_variant_are_the_ones_made_afresh(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(3)
    cases = []
    for _ in range(12):
        p, m = rng.randint(2, 6), rng.randint(1, 12)
        cases.append((p, m, [rng.random() < 0.7 for _ in range(p)], _random_costs(rng, p)))
    clear_caches()
    # the planner's pattern: a quick estimate, a rough one, then the full order
    remembered = [[varuna_order(p, m, rc, costs, variants)
                   for variants in (QUICK_VARIANTS, ROUGH_VARIANTS, None)]
                  for p, m, rc, costs in cases]
    monkeypatch.setattr(varuna_module, "_MEMO_SIZE", 0)  # nothing kept: every order made anew
    clear_caches()
    afresh = [[varuna_order(p, m, rc, costs, variants)
               for variants in (QUICK_VARIANTS, ROUGH_VARIANTS, None)]
              for p, m, rc, costs in cases]
    assert remembered == afresh
    assert not varuna_module._MEMO


def test_stash_floor_is_at_most_every_variants_peak() -> None:
    """The planner drops a candidate without generating its order when even these counts do
    not fit; so no variant's order (of any slack, just-in-time rule or feeding) may hold
    fewer on any stage. Random costs, links, P and m; without recompute."""
    rng = random.Random(5)
    binding = 0
    for _ in range(150):
        p, m = rng.randint(2, 8), rng.randint(1, 20)
        costs = _random_costs(rng, p)
        rc = [False] * p
        floor = varuna_module.stash_floor(p, m, rc, costs)
        assert floor is not None and len(floor) == p
        for slack, jit, feed in varuna_module._VARIANTS:
            cap = [min(m, p - s + (m if slack is None else slack)) for s in range(p)]
            order = varuna_module._generate(costs, m, rc, cap, jit, feed).order
            peaks = peak_stash_counts(Schedule("varuna", p, m, False, order))
            assert all(f <= k for f, k in zip(floor, peaks)), (p, m, floor, peaks, slack)
            binding += sum(f == k > 1 for f, k in zip(floor, peaks))
    assert binding > 100  # and it is a real floor, not ones
    assert varuna_module.stash_floor(3, 4, [True, False, False], _random_costs(rng, 3)) is None


@pytest.mark.parametrize("variants", [None, QUICK_VARIANTS, ROUGH_VARIANTS])
def test_orders_given_up_at_the_first_overflow_decide_as_the_full_order(
        variants: tuple[int, ...] | None) -> None:
    """``overflows`` is True exactly when every variant's order holds more than ``most`` on
    some stage (orders stopped at the first forward too many), so the order ``varuna_order``
    returns overflows too; and it leaves ``varuna_order`` the same order."""
    rng = random.Random(7)
    seen = set()
    tried = range(len(varuna_module._VARIANTS)) if variants is None else variants
    for _ in range(80):
        p, m = rng.randint(2, 7), rng.randint(1, 16)
        rc = [rng.random() < 0.5 and s < p - 1 for s in range(p)]
        costs = _random_costs(rng, p)
        clear_caches()
        order = varuna_order(p, m, rc, costs, variants)
        peaks = peak_stash_counts(Schedule("varuna", p, m, rc, order))
        most = [max(0, k - rng.choice([0, 0, 1, 2])) for k in peaks]
        each = []
        for k in tried:
            slack, jit, feed = varuna_module._VARIANTS[k]
            cap = [min(m, p - s + (m if slack is None else slack)) for s in range(p)]
            one = varuna_module._generate(costs, m, rc, cap, jit, feed).order
            each.append(any(a > b for a, b in
                            zip(peak_stash_counts(Schedule("varuna", p, m, rc, one)), most)))
        clear_caches()
        over = varuna_module.overflows(p, m, rc, costs, variants, most)
        assert over == all(each), (p, m, peaks, most)
        if over:
            assert any(k > n for k, n in zip(peaks, most))
        assert varuna_order(p, m, rc, costs, variants) == order
        seen.add(over)
    assert seen == {True, False}


def test_fastest_breaks_ties_by_stash_then_index_asking_only_the_tied() -> None:
    orders = [[[Action(0, Kind.F, k)]] for k in range(4)]
    asked: list[int] = []

    def stash(index: int) -> int:
        asked.append(index)
        return {0: 5, 1: 3, 2: 3, 3: 1}[index]

    found = [(2.0, 0, orders[0]), (2.0 * (1 + 1e-10), 1, orders[1]), (2.0, 2, orders[2]),
             (3.0, 3, orders[3])]
    assert fastest(found, stash) is orders[1]  # within 1e-9: fewer held, then the earlier
    assert sorted(asked) == [0, 1, 2]  # the slower one's stash was never counted
    asked.clear()
    assert fastest([(1.0, 0, orders[0]), (2.0, 1, orders[1])], stash) is orders[0]
    assert asked == []


def _random_units(rng: np.random.Generator, n: int, negative: bool = False) -> UnitArrays:
    cut = np.concatenate([[0.0], rng.uniform(1, 50, n - 1), [0.0]])
    activations = rng.uniform(0, 30, n)
    if negative:  # a fitted affine can go below zero: the memo must not be used then
        activations[n // 2] = -5.0
    return UnitArrays(
        b=1, positions=np.arange(n + 1), forward=rng.uniform(0.1, 1, n),
        recompute=rng.uniform(0.1, 1, n), backward=rng.uniform(0.2, 2, n),
        weights=rng.uniform(0, 40, n) * (rng.random(n) > 0.3), grads=rng.uniform(0, 10, n),
        activations=activations, cut=cut, workspace=rng.uniform(0, 8, n),
        random=rng.random(n) > 0.8)


def _shared(rng: np.random.Generator, n: int) -> list[SharedWeight]:
    return [SharedWeight(float(rng.uniform(5, 20)), 1.0, np.unique(rng.integers(0, n, 3)))
            for _ in range(2)]


@pytest.mark.parametrize("seed", range(6))
def test_where_stages_stop_fitting_is_found_once_with_the_same_partitions(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Balancer remembers, per (stash count, memory cap), the farthest end of a stage that
    fits from every start; partitions, reaches and greedy bounds must be those of asking the
    memory model at every step (``_fitting_ends`` returning None), caps binding or not."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(12, 60))
    units, shared = _random_units(rng, n, negative=seed == 5), _shared(rng, n)
    bandwidth = float(rng.choice([math.inf, 20.0, 2.0]))
    total = float(units.weights.sum() + units.activations.sum() + units.cut.sum())
    caps = [math.inf, total / 2, total / 5, total / 9, total / 20]
    settings = [(p, cap, tuple(int(c) for c in rng.integers(1, 5, p)))
                for p in (1, 2, 3, 5, 8) if p <= n for cap in caps]
    settings += [(3, caps[2], 2)]

    def run() -> list[Any]:
        out: list[Any] = []
        for recompute in (True, False):
            balancer = Balancer(units, shared, bandwidth, recompute)
            for p, cap, counts in settings:
                plan = balancer.partition(p, cap, counts)
                out.append(None if plan is None else plan.bounds)
                for threshold in (balancer.total / p, balancer.total / (2 * p)):
                    out.append(balancer.greedy(threshold, p, cap, (counts,) * p
                                               if isinstance(counts, int) else counts))
                    out.append(balancer._reach(threshold, cap, max((counts,)
                                               if isinstance(counts, int) else counts)))
            out.append(balancer._monotone)
        return out

    fast = run()
    # every start at once is every start asked one at a time (where it is used: the peak
    # grows with the end)
    for recompute in (True, False):
        balancer = Balancer(units, shared, bandwidth, recompute)
        for cap in caps if balancer._monotone else []:
            for stash in (1, 3):
                assert balancer._reach_all(stash, cap) == [
                    balancer.model.reach(i, stash, recompute, cap, n) for i in range(n)]
    monkeypatch.setattr(Balancer, "_fitting_ends", lambda self, cap, stash: None)
    assert fast == run()
    assert fast[-1] is (seed != 5)  # the negative activation turned the memo off
    assert any(bounds is None for bounds in fast[:-1])  # some caps bound


@pytest.fixture(scope="module")
def gpt() -> Analyzed:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=6, n_embd=128, n_head=4, block_size=64, vocab_size=1000))
    return analyze(model, (torch.zeros(4, 64, dtype=torch.long),))


CLUSTERS = [
    dict(gpus=32, gpus_per_node=8, flops="1TFLOP/s", inter_node_bandwidth="10Gbit/s"),
    dict(gpus=16, gpus_per_node=4, flops="1TFLOP/s", inter_node_bandwidth="1Gbit/s",
         gpu_memory="40MiB"),
    dict(gpus=8, gpus_per_node=8, flops="5TFLOP/s", latency="200us"),
]


@pytest.mark.parametrize("schedule", ["varuna", "auto", "1f1b-zb"])
def test_first_bounds_of_all_candidates_at_once_are_the_bounds_one_at_a_time(
        gpt: Analyzed, schedule: str) -> None:
    table = CostTable.build(gpt.gm)
    for spec in CLUSTERS:
        planner = Planner(table, vf.Cluster(**spec), schedule=schedule,  # type: ignore[arg-type]
                          recompute=True)
        pricer = planner.pricer
        pool = planner.candidates(Space(pricer.cluster.gpus, 4, 64))
        assert floors.all_from_totals(pricer, pool) == [floors.from_totals(pricer, c)
                                                        for c in pool]


def _search(gpt: Analyzed, spec: dict[str, Any], schedule: str, recompute: bool) -> Any:
    clear_caches()
    planner = Planner(CostTable.build(gpt.gm), vf.Cluster(**spec),  # type: ignore[arg-type]
                      schedule=schedule, recompute=recompute)
    result = planner.search(Space(planner.pricer.cluster.gpus, 4, 64), top=6)
    return result.alternatives, result.best.plan.bounds


@pytest.mark.parametrize("cluster, schedule, recompute", tiered(
    [(k, s, r) for k in range(len(CLUSTERS)) for s in ("varuna", "auto") for r in (True, False)],
    [(0, "varuna", True), (1, "auto", True)]))
def test_search_with_every_fast_path_chooses_what_the_plain_paths_choose(
        gpt: Analyzed, cluster: int, schedule: str, recompute: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    fast = _search(gpt, CLUSTERS[cluster], schedule, recompute)
    # every fast path off: compiled simulations, no orders kept, the memory model asked at
    # every greedy step, the first floors one candidate at a time
    monkeypatch.setattr(pricing_module, "simulate_step", simulate)
    monkeypatch.setattr(varuna_module, "_MEMO_SIZE", 0)
    monkeypatch.setattr(Balancer, "_fitting_ends", lambda self, cap, stash: None)
    monkeypatch.setattr(floors, "all_from_totals",
                        lambda pricer, pool: [floors.from_totals(pricer, c) for c in pool])
    monkeypatch.setattr(Pricer, "_cannot_fit", lambda self, c: False)  # every order made
    monkeypatch.setattr(Pricer, "_overflows", lambda self, c, effort: False)  # ... in full
    plain = _search(gpt, CLUSTERS[cluster], schedule, recompute)
    assert [dataclasses.astuple(a) for a in fast[0]] == [dataclasses.astuple(a) for a in plain[0]]
    assert fast[1] == plain[1]


@pytest.mark.parametrize("name", ["1f1b-zb", "gpipe-zb", "varuna-zb"])
def test_split_backward_holds_at_least_its_floor(name: str) -> None:
    """The planner drops a split-backward candidate without making its order when even
    ``order_stash_floor``'s counts do not fit; so no order it could make (any effort) may
    hold fewer on any stage. Random costs, links, P, m and recompute."""
    rng = random.Random(9)
    kind = schedule_spec(name)
    binding = 0
    for _ in range(40):
        p, m = rng.randint(2, 7), rng.randint(1, 16)
        costs = _random_costs(rng, p)
        rc = [rng.random() < 0.5 and s < p - 1 for s in range(p)] if name != "varuna-zb" \
            else [False] * p
        floor = order_stash_floor(kind, p, m, rc, costs)
        assert floor is not None and len(floor) == p
        for effort in ("full", "quick", "rough"):
            peaks = peak_stash_counts(build_schedule(kind, p, m, rc, costs, effort=effort))
            assert all(f <= k for f, k in zip(floor, peaks)), (p, m, floor, peaks, effort)
            binding += sum(f == k > 1 for f, k in zip(floor, peaks))
    assert binding > 20  # a real floor, not ones
