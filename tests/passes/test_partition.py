"""The partitioner on synthetic cost arrays: optimal, within the memory cap, never empty."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from varuna_fx.costs.memory import SharedWeight
from varuna_fx.errors import PartitionError
from varuna_fx.passes.partition import PartitionProblem, partition


def _costs(rng: np.random.Generator, n: int, *, sparse: bool = True, **kw: float) -> PartitionProblem:
    compute = rng.random(n) * (rng.random(n) > 0.4 if sparse else 1.0)
    cut = np.concatenate([[0.0], rng.random(n - 1), [0.0]])
    return PartitionProblem(compute, rng.random(n), rng.random(n), cut, **kw)


def _featured(rng: np.random.Generator, n: int, stages: int, cap: float) -> PartitionProblem:
    """Every memory feature at once: per-stage stash counts, workspace, a weight shared by
    several nodes, and a recompute mode (each stage choosing for itself under "auto")."""
    costs = _costs(rng, n, bandwidth=2.0, memory_cap=cap)
    readers = np.unique(rng.integers(0, n, size=3))
    mode = [True, False, "auto"][int(rng.integers(0, 3))]
    return dataclasses.replace(
        costs, stash_counts=tuple(int(x) for x in rng.integers(1, 4, size=stages)),
        workspace_bytes=rng.random(n) * (rng.random(n) > 0.5), recompute=mode,
        shared=(SharedWeight(float(rng.uniform(0.5, 2.0)), 0.0, readers),) if len(readers) > 1
        else (),
        last_stage_compute=costs.compute * 0.7 if mode is not False else None,
    )


def _stage(c: PartitionProblem, i: int, j: int, k: int, stages: int) -> tuple[float, float, bool]:
    """(cost, memory, recomputes) of stage [i, j) as the k-th, written out plainly: the
    reference for the vectorised memory model and partitioner."""
    last = k == stages - 1
    counts = c.stash_counts if isinstance(c.stash_counts, tuple) else (c.stash_counts,) * stages
    stash = counts[k]
    held = float(c.weight_bytes[i:j].sum())
    for item in c.shared:  # a copy where read, unless the first reader is on this stage
        if min(item.nodes) < i and any(i <= r < j for r in item.nodes):
            held += item.held
    workspace = float(c.workspace_bytes[i:j].max()) if c.workspace_bytes is not None else 0.0
    acts = float(c.activation_bytes[i:j].sum())
    plain = held + workspace + stash * (c.cut_bytes[i] + acts)
    replay = held + workspace + stash * c.cut_bytes[i] + acts
    recomputes = not last and (c.recompute is True or (c.recompute == "auto"
                                                       and plain > c.memory_cap))
    plain_times = c.last_stage_compute if c.last_stage_compute is not None else c.compute
    times = c.compute if recomputes or (c.recompute is True and not last) else plain_times
    send = c.cut_bytes[j] / c.bandwidth if not last else 0.0
    return float(times[i:j].sum() + send), float(replay if recomputes else plain), recomputes


def _brute_force(c: PartitionProblem, stages: int) -> float:
    n = len(c.compute)
    best = np.inf
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        if any(not np.isfinite(c.cut_bytes[j]) for j in cuts):
            continue
        priced = [_stage(c, i, j, k, stages) for k, (i, j) in enumerate(zip(bounds, bounds[1:]))]
        if any(memory > c.memory_cap for _, memory, _ in priced):
            continue
        best = min(best, max(cost for cost, _, _ in priced))
    return best


@pytest.mark.parametrize("seed", range(60))
def test_bottleneck_is_optimal_against_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 10))
    stages = int(rng.integers(1, n + 1))
    cap = float(rng.uniform(1.5, 6.0)) if seed % 3 == 0 else float("inf")
    costs = _costs(rng, n, bandwidth=2.0, memory_cap=cap)
    if seed >= 40:  # the memory model's every term, caps that bind about half the time
        costs = _featured(rng, n, stages, float(rng.uniform(3.0, 12.0)))
    expected = _brute_force(costs, stages)
    if not np.isfinite(expected):
        with pytest.raises(PartitionError):
            partition(costs, stages)
        return
    result = partition(costs, stages)
    assert result.bottleneck == pytest.approx(expected, rel=1e-12, abs=1e-12)
    pairs = list(zip(result.bounds, result.bounds[1:]))
    assert len(pairs) == stages and all(i < j for i, j in pairs), "an empty stage"
    reference = [_stage(costs, i, j, k, stages) for k, (i, j) in enumerate(pairs)]
    assert max(cost for cost, _, _ in reference) == pytest.approx(expected)
    assert result.stage_times == pytest.approx([cost for cost, _, _ in reference])
    assert result.stage_memory == pytest.approx([memory for _, memory, _ in reference])
    assert result.recompute == tuple(flag for _, _, flag in reference)
    assert all(memory <= costs.memory_cap + 1e-9 for memory in result.stage_memory)


def test_memory_cap_forces_a_worse_but_fitting_partition() -> None:
    # four equal nodes; the first two are heavy in memory
    costs = PartitionProblem(np.ones(4), np.array([5.0, 5.0, 0.0, 0.0]), np.zeros(4), np.zeros(5))
    assert partition(costs, 2).bounds == (0, 2, 4)
    capped = PartitionProblem(costs.compute, costs.weight_bytes, costs.activation_bytes,
                            costs.cut_bytes, memory_cap=6.0)
    result = partition(capped, 2)
    assert result.bounds == (0, 1, 4)
    assert max(result.stage_memory) <= 6.0


def test_nothing_fits_names_stage_bytes_and_memory() -> None:
    costs = PartitionProblem(np.ones(3), np.full(3, 2**30), np.zeros(3), np.zeros(4),
                           memory_cap=2**29)
    with pytest.raises(PartitionError, match=r"fits in 512.0 MiB per device.*GiB on stage \d"):
        partition(costs, 2)


def test_prefers_the_cut_where_fewer_bytes_cross() -> None:
    # nodes 1 and 2 are free (views): cutting before node 1 or before node 2 balances equally,
    # but far fewer bytes cross before node 2
    compute = np.array([1.0, 0.0, 0.0, 1.0])
    cut = np.array([0.0, 100.0, 1.0, 50.0, 0.0])
    result = partition(PartitionProblem(compute, np.zeros(4), np.zeros(4), cut), 2)
    assert result.bounds == (0, 2, 4)


def test_forbidden_cuts_are_never_chosen() -> None:
    cut = np.array([0.0, np.inf, np.inf, 0.0, np.inf, 0.0])
    result = partition(PartitionProblem(np.ones(5), np.zeros(5), np.zeros(5), cut), 2)
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
    costs = PartitionProblem(rng.random(n), np.zeros(n), np.zeros(n),
                           np.concatenate([[0.0], rng.random(n - 1) * 1e-3, [0.0]]))
    result = partition(costs, 8)
    mean = costs.compute.sum() / 8
    assert result.bottleneck / mean < 1.01


def test_last_stage_is_costed_without_recompute() -> None:
    # with recompute every node costs 3 (F + R + B) except on the last stage (F + B = 2)
    compute = np.full(5, 3.0)
    plain = PartitionProblem(compute, np.zeros(5), np.zeros(5), np.zeros(6))
    aware = dataclasses.replace(plain, last_stage_compute=np.full(5, 2.0))
    assert partition(plain, 2).bounds in ((0, 2, 5), (0, 3, 5))
    result = partition(aware, 2)
    assert result.bounds == (0, 2, 5)  # the last stage can take three nodes: 6 = 2 * 3
    assert result.stage_times == (6.0, 6.0)
