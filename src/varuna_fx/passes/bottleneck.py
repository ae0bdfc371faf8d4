"""The dynamic programme over cut positions that both partition searches share.

``cost(k)`` is the [U + 1, U + 1] matrix of stage ``[i, j)``'s cost as the k-th stage (inf
where it may not be); a partition's bottleneck is its costliest stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

_REL_TOL = 1e-9


def smallest_bottleneck(cost: Callable[[int], np.ndarray], num_stages: int, units: int) -> float:
    """The smallest bottleneck of any partition of ``units`` into ``num_stages`` stages (inf
    if none is possible)."""
    if num_stages > units:
        return float("inf")
    # best[j]: smallest bottleneck of splitting units [0, j) into k + 1 stages
    best = cost(0)[0]
    for k in range(1, num_stages):
        best = np.min(np.maximum(best[:, None], cost(k)), axis=0)
    return float(best[units])


def fewest_bytes(cost: Callable[[int], np.ndarray], cut: np.ndarray, num_stages: int,
                 bottleneck: float, weights: Sequence[float] | None = None) -> list[int]:
    """Among partitions whose every stage costs <= bottleneck, the one sending fewest bytes
    (``cost(k)``: the matrix of stage costs as the k-th stage). ``weights``: per boundary
    (P - 1), what a byte across it counts for (a slow link's more); None: all alike."""
    n = len(cut) - 1
    limit = bottleneck * (1 + _REL_TOL) + 1e-300
    crossing = np.where(np.isfinite(cut), cut, np.inf)
    total = np.full((num_stages, n + 1), np.inf)
    parent = np.zeros((num_stages, n + 1), dtype=np.int64)
    total[0] = np.where(cost(0)[0] <= limit, 0.0, np.inf)
    for k in range(1, num_stages):
        # entering stage k at cut i costs the bytes crossing cut i (over boundary k - 1)
        entering = crossing if weights is None else crossing * float(weights[k - 1])
        candidates = np.where(cost(k) <= limit, (total[k - 1] + entering)[:, None], np.inf)
        parent[k] = np.argmin(candidates, axis=0)
        total[k] = candidates[parent[k], np.arange(n + 1)]
    bounds = [n]
    for k in range(num_stages - 1, 0, -1):
        bounds.append(int(parent[k][bounds[-1]]))
    bounds.append(0)
    return bounds[::-1]
