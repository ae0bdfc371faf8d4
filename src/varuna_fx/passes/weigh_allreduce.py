"""Weighing each stage's data-parallel all-reduce in the partition.

With D > 1 replicas each stage all-reduces the gradients of the parameters it holds (its own
copies of tied weights included) once per step, after its last backward: a cost the
per-micro-batch bottleneck does not see. The partition then minimises the step's own shape,
``(m + P - 1) x bottleneck + the largest stage's all-reduce`` (the planner prices a step as the
simulated pipeline plus the largest stage's all-reduce).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ..costs.memory import MemoryModel, SharedWeight
from .bottleneck import Banded, fewest_bytes, smallest_bottleneck

_AR_GRID = 12  # all-reduce caps tried between the unweighed partition's and the lower bound
_AR_REFINE = 4  # then this many between the best cap and the one above it
_FEWER_BYTES = 0.5  # "several times fewer": as partition.py's rule


class AllReduce:
    """Seconds of stage [i, j)'s all-reduce over its replicas (the gradients of the parameters
    it holds, tied copies included); ``i`` and ``j`` broadcast."""

    def __init__(self, grads: MemoryModel, per_byte: float, latency: float) -> None:
        self.grads, self.per_byte, self.latency = grads, per_byte, latency

    @classmethod
    def of(cls, grad_bytes: np.ndarray | None, shared: Sequence[SharedWeight],
           per_byte: float, latency: float, n: int) -> AllReduce | None:
        """None with nothing to weigh (one replica, or no gradients)."""
        if per_byte <= 0 or grad_bytes is None:
            return None
        grads = MemoryModel(np.asarray(grad_bytes, dtype=np.float64), np.zeros(n),
                            np.zeros(n + 1), np.zeros(n),
                            [SharedWeight(s.grad, s.grad, s.nodes) for s in shared])
        return cls(grads, per_byte, latency)

    def __call__(self, i: np.ndarray | int, j: np.ndarray | int) -> np.ndarray:
        held = np.maximum(self.grads.held(i, j), 0.0)
        return np.where(held > 0, held * self.per_byte + self.latency, 0.0)


class WithAllReduce(Banded, Protocol):
    """The partition's stages (``stage_costs.StageCosts``) as this search uses them."""

    def allreduce(self) -> np.ndarray:
        """[U + 1, width]: each band stage's all-reduce seconds."""
        ...

    def at(self, k: int, i: int, j: int) -> float:
        """Stage [i, j)'s cost as the k-th stage."""
        ...

    @property
    def reduces(self) -> AllReduce | None: ...


class _Capped:
    """``stages`` with every stage whose all-reduce exceeds ``cap`` forbidden."""

    def __init__(self, stages: WithAllReduce, cap: float) -> None:
        self.stages, self.cap = stages, cap
        # id of the stages' matrix -> (that matrix, kept so its id is not reused; its mask)
        self._made: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def width(self) -> int:
        return self.stages.width

    @property
    def covers(self) -> float:
        return self.stages.covers

    def widen(self, limit: float) -> None:
        self.stages.widen(limit)

    def cost(self, k: int) -> np.ndarray:
        matrix = self.stages.cost(k)  # one cached matrix per kind of stage
        if id(matrix) not in self._made:
            self._made[id(matrix)] = (matrix, np.where(self.stages.allreduce() <= self.cap,
                                                       matrix, np.inf))
        return self._made[id(matrix)][1]


def weigh_allreduce(stages: WithAllReduce, cut: np.ndarray, num_stages: int,
                    plain: list[int], micro_batches: int, byte_tolerance: float = 0.0,
                    weights: Sequence[float] | None = None) -> list[int]:
    """Bounds minimising ``(m + P - 1) x bottleneck + the largest stage all-reduce``.

    The smallest bottleneck under a cap A on every stage's all-reduce, B(A), only grows as A
    falls, and a partition under cap A scores at most ``(m + P - 1) B(A) + A``. So the caps
    worth trying lie between the unweighed partition's largest all-reduce (``plain``, kept
    when nothing beats it) and a lower bound of any partition's: a geometric grid over that
    range, then a finer one around the best, each cap one bottleneck programme with the
    stages over it forbidden; only the best cap's partition is made (fewest bytes among its
    optimal ones, as ``partition``). The grid stops once the pipeline part alone reaches the
    best score (lower caps cannot help)."""
    fill = micro_batches + num_stages - 1
    units = len(cut) - 1
    reduces = stages.reduces
    assert reduces is not None

    def score(bounds: list[int]) -> float:
        pairs = list(zip(bounds, bounds[1:]))
        slowest = max(stages.at(k, i, j) for k, (i, j) in enumerate(pairs))
        return fill * slowest + max(float(reduces(i, j)) for i, j in pairs)

    def sent(bounds: list[int]) -> float:  # bytes crossing the cuts, weighed by link
        inner = bounds[1:-1]
        w = [1.0] * len(inner) if weights is None else weights
        return float(sum(cut[j] * x for j, x in zip(inner, w)))

    plain_score = score(plain)
    top = max(float(reduces(i, j)) for i, j in zip(plain, plain[1:]))
    singles = reduces(np.arange(units), np.arange(1, units + 1))
    floor = max(float(singles.max(initial=0.0)), float(reduces(0, units)) / num_stages)
    if not top > floor > 0:
        return plain
    loose_ok = byte_tolerance > 0
    best: tuple[float, float, float] | None = None  # (estimate, cap, bottleneck)
    tried = [top]

    def attempt(cap: float) -> bool:
        """Try ``cap``; False when every lower cap is hopeless (or none is possible)."""
        nonlocal best
        tried.append(cap)
        limit = plain_score if best is None else best[0]
        # (only a bottleneck under limit / fill can help: no need to prove none exists)
        found = smallest_bottleneck(_Capped(stages, cap), num_stages, units,
                                    below=limit / fill * (1 + 1e-9))
        if not np.isfinite(found) or fill * found >= limit:
            return False
        if fill * found + cap < limit:
            best = (fill * found + cap, cap, found)
        return True

    ratio = (floor / top) ** (1 / _AR_GRID)
    for step in range(1, _AR_GRID + 1):
        if not attempt(top * ratio**step):
            break
    if best is None:
        return plain
    above = min((c for c in tried if c > best[1]), default=top)
    fine = (best[1] / above) ** (1 / (_AR_REFINE + 1))
    for step in range(1, _AR_REFINE + 1):  # finer between the best cap and the one above
        attempt(above * fine**step)
    _, cap, found = best
    bounds = fewest_bytes(_Capped(stages, cap), cut, num_stages, found, weights)
    chosen = bounds if score(bounds) < plain_score * (1 - 1e-12) else plain
    if loose_ok and chosen is bounds:
        slack = 1 + byte_tolerance
        loose = fewest_bytes(_Capped(stages, cap * slack), cut, num_stages, found * slack,
                             weights)
        for other in (plain, loose):  # fewer bytes, nearly as good
            if score(other) <= score(chosen) * slack and \
                    sent(other) <= _FEWER_BYTES * sent(chosen):
                chosen = other
    return chosen
