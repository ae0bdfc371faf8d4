"""The partitioner on synthetic cost arrays: optimal, within the memory cap, never empty."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from varuna_fx.errors import PartitionError
from varuna_fx.passes.partition import PartitionCosts, partition


def _costs(rng: np.random.Generator, n: int, *, sparse: bool = True, **kw: float) -> PartitionCosts:
    compute = rng.random(n) * (rng.random(n) > 0.4 if sparse else 1.0)
    cut = np.concatenate([[0.0], rng.random(n - 1), [0.0]])
    return PartitionCosts(compute, rng.random(n), rng.random(n), cut, **kw)


def _stage_cost(c: PartitionCosts, i: int, j: int) -> float:
    send = c.cut_bytes[j] / c.bandwidth if j < len(c.compute) else 0.0
    return float(c.compute[i:j].sum() + send)


def _stage_memory(c: PartitionCosts, i: int, j: int) -> float:
    stash = c.in_flight * c.cut_bytes[i] + c.activation_bytes[i:j].sum()
    return float(c.weight_bytes[i:j].sum() + stash)


def _brute_force(c: PartitionCosts, stages: int) -> float:
    n = len(c.compute)
    best = np.inf
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        pairs = list(zip(bounds, bounds[1:]))
        if any(not np.isfinite(c.cut_bytes[j]) for j in cuts):
            continue
        if any(_stage_memory(c, i, j) > c.memory_cap for i, j in pairs):
            continue
        best = min(best, max(_stage_cost(c, i, j) for i, j in pairs))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_bottleneck_is_optimal_against_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 10))
    stages = int(rng.integers(1, n + 1))
    cap = float(rng.uniform(1.5, 6.0)) if seed % 3 == 0 else float("inf")
    costs = _costs(rng, n, bandwidth=2.0, memory_cap=cap)
    expected = _brute_force(costs, stages)
    if not np.isfinite(expected):
        with pytest.raises(PartitionError):
            partition(costs, stages)
        return
    result = partition(costs, stages)
    assert result.bottleneck == pytest.approx(expected, rel=1e-12, abs=1e-12)
    pairs = list(zip(result.bounds, result.bounds[1:]))
    assert len(pairs) == stages and all(i < j for i, j in pairs), "an empty stage"
    assert max(_stage_cost(costs, i, j) for i, j in pairs) == pytest.approx(expected)
    assert all(_stage_memory(costs, i, j) <= cap + 1e-9 for i, j in pairs)


def test_memory_cap_forces_a_worse_but_fitting_partition() -> None:
    # four equal nodes; the first two are heavy in memory
    costs = PartitionCosts(np.ones(4), np.array([5.0, 5.0, 0.0, 0.0]), np.zeros(4), np.zeros(5))
    assert partition(costs, 2).bounds == (0, 2, 4)
    capped = PartitionCosts(costs.compute, costs.weight_bytes, costs.activation_bytes,
                            costs.cut_bytes, memory_cap=6.0)
    result = partition(capped, 2)
    assert result.bounds == (0, 1, 4)
    assert max(result.stage_memory) <= 6.0


def test_nothing_fits_names_stage_bytes_and_memory() -> None:
    costs = PartitionCosts(np.ones(3), np.full(3, 2**30), np.zeros(3), np.zeros(4),
                           memory_cap=2**29)
    with pytest.raises(PartitionError, match=r"stage \d.*GiB.*0.50 GiB|0.50 GiB.*stage"):
        partition(costs, 2)


def test_prefers_the_cut_where_fewer_bytes_cross() -> None:
    # nodes 1 and 2 are free (views): cutting before node 1 or before node 2 balances equally,
    # but far fewer bytes cross before node 2
    compute = np.array([1.0, 0.0, 0.0, 1.0])
    cut = np.array([0.0, 100.0, 1.0, 50.0, 0.0])
    result = partition(PartitionCosts(compute, np.zeros(4), np.zeros(4), cut), 2)
    assert result.bounds == (0, 2, 4)


def test_forbidden_cuts_are_never_chosen() -> None:
    cut = np.array([0.0, np.inf, np.inf, 0.0, np.inf, 0.0])
    result = partition(PartitionCosts(np.ones(5), np.zeros(5), np.zeros(5), cut), 2)
    assert result.bounds == (0, 3, 5)


@pytest.mark.parametrize("stages", [0, -1])
def test_fewer_than_one_stage_is_an_error(stages: int) -> None:
    with pytest.raises(PartitionError, match="at least 1"):
        partition(_costs(np.random.default_rng(0), 4), stages)


def test_more_stages_than_operations_is_an_error() -> None:
    with pytest.raises(PartitionError, match="more than the 4 operations"):
        partition(_costs(np.random.default_rng(0), 4), 5)


@pytest.mark.slow  # a timing check on a large problem
def test_large_problem_stays_fast_and_balanced() -> None:
    rng = np.random.default_rng(1)
    n = 1500
    costs = PartitionCosts(rng.random(n), np.zeros(n), np.zeros(n),
                           np.concatenate([[0.0], rng.random(n - 1) * 1e-3, [0.0]]))
    result = partition(costs, 8)
    mean = costs.compute.sum() / 8
    assert result.bottleneck / mean < 1.01


def test_last_stage_is_costed_without_recompute() -> None:
    # with recompute every node costs 3 (F + R + B) except on the last stage (F + B = 2)
    compute = np.full(5, 3.0)
    plain = PartitionCosts(compute, np.zeros(5), np.zeros(5), np.zeros(6))
    aware = dataclasses.replace(plain, last_stage_compute=np.full(5, 2.0))
    assert partition(plain, 2).bounds in ((0, 2, 5), (0, 3, 5))
    result = partition(aware, 2)
    assert result.bounds == (0, 2, 5)  # the last stage can take three nodes: 6 = 2 * 3
    assert result.stage_costs == (6.0, 6.0)
