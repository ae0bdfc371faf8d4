"""The partition's band (``passes/bottleneck.py``): pricing only the stages that could matter
chooses exactly what pricing every stage [i, j) chooses, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from varuna_fx.costs.memory import SharedWeight
from varuna_fx.errors import PartitionError
from varuna_fx.passes import stage_costs
from varuna_fx.passes.partition import PartitionProblem, partition


def _problem(rng: np.random.Generator, n: int, stages: int) -> PartitionProblem:
    """Every feature the band must keep exact: free and heavy units, forbidden cuts, a memory
    cap that binds about half the time, per-stage stash counts, a shared weight, recompute
    modes, links of two speeds, and data-parallel all-reduce."""
    compute = rng.random(n) * (rng.random(n) > 0.3) * np.where(rng.random(n) > 0.9, 8.0, 1.0)
    cut = np.concatenate([[0.0], rng.random(n - 1), [0.0]])
    cut[1:-1][rng.random(n - 1) > 0.85] = np.inf
    mode = [True, False, "auto"][int(rng.integers(0, 3))]
    readers = np.unique(rng.integers(0, n, size=3))
    weights = rng.random(n)
    acts = rng.random(n)
    cap = float("inf") if rng.random() < 0.3 else \
        float(rng.uniform(1.2, 3.0) * (weights.sum() + acts.sum()) / stages + 2)
    fast, slow = float(rng.uniform(2, 20)), float(rng.uniform(0.2, 2))
    return PartitionProblem(
        compute, weights, acts, cut, bandwidth=fast,
        bandwidths=tuple(slow if k % 3 == 2 else fast for k in range(stages - 1))
        if rng.random() < 0.5 else None,
        memory_cap=cap,
        stash_counts=tuple(int(x) for x in rng.integers(1, 5, size=stages)),
        recompute=mode, last_stage_compute=compute * 0.7 if mode is not False else None,
        workspace_bytes=rng.random(n) * (rng.random(n) > 0.5),
        shared=(SharedWeight(float(rng.uniform(0.5, 2.0)), 0.3, readers),)
        if len(readers) > 1 else (),
        grad_bytes=weights * (rng.random(n) > 0.2),
        allreduce_per_byte=float(rng.choice([0.0, rng.uniform(0.1, 5.0)])),
        allreduce_latency=0.01, micro_batches=int(rng.integers(1, 16)),
    )


def _seeded(seed: int) -> tuple[PartitionProblem, int]:
    """A random problem of 20-160 units and the stages to cut it into."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(20, 160))
    stages = int(rng.integers(2, min(24, n // 3)))
    return _problem(rng, n, stages), stages


def _whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every band the whole matrix (what the partition priced before the band)."""
    monkeypatch.setattr(stage_costs.StageCosts, "_width_for",
                        lambda self, limit: self.n + 1)


@pytest.mark.parametrize("seed", range(40))
def test_the_band_chooses_what_the_whole_matrix_chooses(seed: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    costs, stages = _seeded(seed)
    try:
        banded = partition(costs, stages)
    except PartitionError as refused:
        _whole(monkeypatch)
        with pytest.raises(PartitionError, match=str(refused)[:40]):
            partition(costs, stages)
        return
    _whole(monkeypatch)
    assert partition(costs, stages) == banded


def test_many_stages_price_a_narrow_band(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 balanced stages of 4000 units: the band holds about 2 stages' worth of starts per
    end, not all 4000 (the 70B Llama's partition priced the whole matrix: minutes, GBs)."""
    rng = np.random.default_rng(0)
    n, stages = 4000, 64
    costs = PartitionProblem(rng.uniform(0.5, 1.5, n), rng.random(n), rng.random(n),
                             np.concatenate([[0.0], rng.random(n - 1), [0.0]]),
                             bandwidth=100.0, stash_counts=tuple(range(stages, 0, -1)),
                             memory_cap=float(n))
    seen: list[int] = []
    real = stage_costs.StageCosts._set_width

    def spy(self: stage_costs.StageCosts, width: int) -> None:
        seen.append(width)
        real(self, width)

    monkeypatch.setattr(stage_costs.StageCosts, "_set_width", spy)
    result = partition(costs, stages)
    assert max(seen) < 3 * n // stages
    assert result.num_stages == stages


@pytest.mark.parametrize("seed", range(0, 40, 4))
def test_a_cache_of_one_matrix_chooses_what_a_large_one_does(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Matrices evicted and made again (a big model keeps few) give the same partition: the
    all-reduce caps' masked copies follow their matrix, not a reused address (the 70B's
    partition once differed between two processes planning the same world)."""
    costs, stages = _seeded(seed)
    try:
        expected = partition(costs, stages)
    except PartitionError:
        return
    real = stage_costs.StageCosts._set_width

    def tiny(self: stage_costs.StageCosts, width: int) -> None:
        real(self, width)
        self._cache_size = 1

    monkeypatch.setattr(stage_costs.StageCosts, "_set_width", tiny)
    assert partition(costs, stages) == expected
