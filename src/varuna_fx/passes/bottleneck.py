"""The dynamic programme over cut positions that both partition searches share, on a band.

A stage ``[i, j)`` of the U units is priced as the k-th stage by ``cost(k)``. Only stages that
could matter are priced: those not certain to cost more than ``covers`` (their compute alone
exceeds it), which for P balanced stages are the ones at most about 2U/P units long. So
``cost(k)`` is a *band*, [U + 1, width], whose row j holds the stages ending at j and starting
at ``j - width .. j - 1`` (inf where a stage may not be, or starts before 0). Every stage
outside the band costs more than ``covers``; a programme whose answer is below ``covers`` is
therefore the answer over all stages, bit for bit (its stages are all in the band, and the
minima and maxima taken are the same numbers), and one whose answer is not widens the band and
runs again (up to the whole [U + 1, U + 1] matrix, where nothing is left out). For a 70B Llama
cut in 64 stages this priced ~30x fewer stages than the whole matrix, in memory and time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

_REL_TOL = 1e-9


class Banded(Protocol):
    """Stage costs on a band (see the module doc)."""

    @property
    def width(self) -> int:
        """Starts per end held: row j of ``cost(k)`` is stages [j - width + t, j), t < width."""
        ...

    @property
    def covers(self) -> float:
        """Every stage outside the band costs more than this (inf: the band is everything)."""
        ...

    def cost(self, k: int) -> np.ndarray:
        """[U + 1, width]: the cost of each stage in the band as the k-th stage."""
        ...

    def widen(self, limit: float) -> None:
        """Widen the band until ``covers`` exceeds ``limit`` (or the band holds every stage)."""
        ...


def windows(values: np.ndarray, width: int) -> np.ndarray:
    """[len(values), width] (a view): row j holds ``values[j - width .. j - 1]``, inf before 0:
    the value at each band entry's start."""
    padded = np.concatenate([np.full(width, np.inf), values])
    return sliding_window_view(padded, width)[: len(values)]


def smallest_bottleneck(stages: Banded, num_stages: int, units: int,
                        below: float = float("inf")) -> float:
    """The smallest bottleneck of any partition of ``units`` into ``num_stages`` stages (inf
    if none is possible). ``below``: where only a bottleneck under it matters, a value at
    least ``below`` is returned as it was found, when the smallest is at least that too: one
    programme over a band wide enough for ``below``, where proving that no partition exists
    (a cap forbidding every stage) would widen it to the whole matrix."""
    if num_stages > units:
        return float("inf")
    if np.isfinite(below):
        stages.widen(below)
    while True:
        found = _bottleneck_in_band(stages, num_stages, units)
        if found < stages.covers or not np.isfinite(stages.covers):
            return found  # every stage of the optimum is in the band: it is the optimum
        if found >= below:  # (covers > below: a partition under ``below`` was in the band)
            return found
        # the band left out stages that may do better: widen past what was found (the
        # optimum is at most that), or, where nothing was found, by a factor
        stages.widen(found if np.isfinite(found) else 4 * stages.covers)


def _bottleneck_in_band(stages: Banded, num_stages: int, units: int) -> float:
    # best[j]: smallest bottleneck of splitting units [0, j) into the stages so far
    best = np.full(units + 1, np.inf)
    best[0] = 0.0
    for k in range(num_stages):
        best = np.min(np.maximum(windows(best, stages.width), stages.cost(k)), axis=1)
    return float(best[units])


def fewest_bytes(stages: Banded, cut: np.ndarray, num_stages: int, bottleneck: float,
                 weights: Sequence[float] | None = None) -> list[int]:
    """Among partitions whose every stage costs <= bottleneck, the one sending fewest bytes
    (the lowest cut positions on ties). ``weights``: per boundary (P - 1), what a byte
    across it counts for (a slow link's more); None: all alike."""
    n = len(cut) - 1
    limit = bottleneck * (1 + _REL_TOL) + 1e-300
    stages.widen(limit)  # every stage that fits under the limit is in the band
    width = stages.width
    crossing = np.where(np.isfinite(cut), cut, np.inf)
    ends = np.arange(n + 1)
    total = np.full(n + 1, np.inf)  # fewest bytes sent splitting [0, j) so far
    total[0] = 0.0
    parents = []
    for k in range(num_stages):
        # entering stage k at cut i costs the bytes crossing cut i (over boundary k - 1)
        entering = 0.0 if k == 0 else \
            crossing if weights is None else crossing * float(weights[k - 1])
        candidates = np.where(stages.cost(k) <= limit, windows(total + entering, width),
                              np.inf)
        pick = np.argmin(candidates, axis=1)  # the first of equals: the lowest start
        parents.append(ends - width + pick)
        total = candidates[ends, pick]
    bounds = [n]
    for k in range(num_stages - 1, 0, -1):
        bounds.append(int(parents[k][bounds[-1]]))
    bounds.append(0)
    return bounds[::-1]
