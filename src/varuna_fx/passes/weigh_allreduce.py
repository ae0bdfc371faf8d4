"""Weighing each stage's data-parallel all-reduce in the partition.

With D > 1 replicas each stage all-reduces the gradients of the parameters it holds (its own
copies of tied weights included) once per step, after its last backward: a cost the
per-micro-batch bottleneck does not see. The partition then minimises the step's own shape,
``(m + P - 1) x bottleneck + the largest stage's all-reduce`` (the planner prices a step as the
simulated pipeline plus the largest stage's all-reduce).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..costs.memory import MemoryModel, SharedWeight
from .bottleneck import fewest_bytes, smallest_bottleneck

_AR_GRID = 12  # all-reduce caps tried between the unweighed partition's and the lower bound
_AR_REFINE = 4  # then this many between the best cap and its neighbours


def allreduce_matrix(grad_bytes: np.ndarray | None, shared: Sequence[SharedWeight],
                     per_byte: float, latency: float, n: int) -> np.ndarray | None:
    """[U + 1, U + 1]: seconds of stage [i, j)'s all-reduce over its replicas (the gradients
    of the parameters it holds, tied copies included), or None with nothing to weigh."""
    if per_byte <= 0 or grad_bytes is None:
        return None
    grads = MemoryModel(np.asarray(grad_bytes, dtype=np.float64), np.zeros(n),
                        np.zeros(n + 1), np.zeros(n),
                        [SharedWeight(s.grad, s.grad, s.nodes) for s in shared])
    idx = np.arange(n + 1)
    held = np.maximum(grads.held(idx[:, None], idx[None, :]), 0.0)
    return np.where(held > 0, held * per_byte + latency, 0.0)


def weigh_allreduce(stage_cost: Callable[[int], np.ndarray], cut: np.ndarray,
                    allreduce: np.ndarray, num_stages: int, plain: list[int],
                    micro_batches: int) -> list[int]:
    """Bounds minimising ``(m + P - 1) x bottleneck + the largest stage all-reduce``.

    The smallest bottleneck under a cap A on every stage's all-reduce, B(A), only grows as A
    falls, so the caps worth trying lie between the unweighed partition's largest all-reduce
    (``plain``, kept when nothing beats it) and the lower bound of any partition's; a
    geometric grid over that range, then a finer one around the best, each cap a dynamic
    programme with the stages that exceed it forbidden (fewest bytes among the optimal, as
    ``partition``). The search stops once the pipeline part alone reaches the best score."""
    fill = micro_batches + num_stages - 1
    units = len(cut) - 1

    def score(bounds: list[int]) -> float:
        pairs = list(zip(bounds, bounds[1:]))
        slowest = max(float(stage_cost(k)[i, j]) for k, (i, j) in enumerate(pairs))
        return fill * slowest + max(float(allreduce[i, j]) for i, j in pairs)

    def capped(cap: float) -> tuple[float, list[int] | None]:
        def cost(k: int) -> np.ndarray:
            return np.where(allreduce <= cap, stage_cost(k), np.inf)

        found = smallest_bottleneck(cost, num_stages, units)
        return found, fewest_bytes(cost, cut, num_stages, found) if np.isfinite(found) \
            else None

    best, best_score = plain, score(plain)
    top = max(float(allreduce[i, j]) for i, j in zip(plain, plain[1:]))
    singles = allreduce[np.arange(units), np.arange(1, units + 1)]
    floor = max(float(singles.max(initial=0.0)), float(allreduce[0, units]) / num_stages)
    if not top > floor > 0:
        return best
    ratio = (floor / top) ** (1 / _AR_GRID)
    tried: list[float] = [top]

    def attempt(cap: float) -> bool:
        """Try ``cap``; False when every lower cap is hopeless (or none is possible)."""
        nonlocal best, best_score
        tried.append(cap)
        found, bounds = capped(cap)
        if bounds is None or fill * found >= best_score:
            return False
        if score(bounds) < best_score * (1 - 1e-12):
            best, best_score = bounds, score(bounds)
        return True

    for step in range(1, _AR_GRID + 1):
        if not attempt(top * ratio**step):
            break
    # finer between the neighbours of the best cap found
    if best is not plain:
        at = max(float(allreduce[i, j]) for i, j in zip(best, best[1:]))
        above = min((c for c in tried if c > at), default=top)
        fine = (at / above) ** (1 / (_AR_REFINE + 1)) if above > at > 0 else 1.0
        for step in range(1, _AR_REFINE + 1):
            attempt(above * fine**step)
    return best
