"""The partition's stage costs on a band (``bottleneck.py``): cost, memory and recompute choice
of each stage [i, j) that could matter, as the k-th of P stages, for the exact partition
(``partition.py``) and its all-reduce weighing (``weigh_allreduce.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..costs.memory import peak_bytes
from .weigh_allreduce import AllReduce


class StageCosts:
    """Cost, memory and recompute choice of every candidate stage [i, j) as the k-th of
    ``num_stages`` stages, on a band of the (reduced) cut positions (``bottleneck.py``: row j
    holds the stages ending at j and starting at ``j - width .. j - 1``). Memory depends on k
    through the stage's stash count; a stage ending at N is the last one (k = P - 1), which
    never recomputes and is the only one allowed to end there."""

    def __init__(self, costs: Any, num_stages: int,
                 allreduce: AllReduce | None = None) -> None:
        """``costs``: the (reduced) ``partition.PartitionProblem`` (not imported: that module
        imports this one)."""
        n = len(costs.compute)
        self.n, self.num_stages, self.cap = n, num_stages, costs.memory_cap
        self.mode = costs.recompute
        self.stash = costs.counts(num_stages)
        self.model = costs.memory_model()
        cut = np.asarray(costs.cut_bytes, dtype=np.float64)
        self.cut = cut
        self.bandwidths = costs.bandwidths
        if self.bandwidths is not None and len(self.bandwidths) != num_stages - 1:
            raise ValueError(f"bandwidths has {len(self.bandwidths)} entries for "
                             f"{num_stages - 1} boundaries")
        forbidden = ~np.isfinite(cut)
        forbidden[0] = forbidden[n] = False
        self.forbidden = forbidden  # a stage may not start at a forbidden cut, nor end at one
        self._compute, self._plain = costs.compute, costs.last_stage_compute
        self.default_bandwidth = costs.bandwidth
        self._prefix = {False: _prefix(self._compute)}
        if self._plain is not None:
            self._prefix[True] = _prefix(self._plain)
        # the least any stage [i, j) computes (recomputing or not): what bounds the band
        least = self._compute if self._plain is None else np.minimum(self._compute,
                                                                      self._plain)
        self._least = _prefix(least)
        self.reduces = allreduce  # each stage's all-reduce over its replicas, or None
        self.width, self.covers = 0, 0.0
        total = float(self._least[-1])
        self._set_width(self._width_for(2 * total / num_stages) if total > 0 else n + 1)

    # -- the band --------------------------------------------------------------------------

    def _covers(self, width: int) -> float:
        """What every stage longer than ``width`` units computes at least (inf: none is)."""
        if width >= self.n:
            return float("inf")
        sums = self._least[width + 1:] - self._least[: self.n - width]
        return float(sums.min()) * (1 - 1e-9)  # (room for the prefix sums' rounding)

    def _width_for(self, limit: float) -> int:
        """The narrowest band whose ``covers`` exceeds ``limit``."""
        lo, hi = 1, self.n + 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self._covers(mid) > limit:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _set_width(self, width: int) -> None:
        self.width, self.covers = width, self._covers(width)
        n = self.n
        ends = np.arange(n + 1)[:, None]
        starts = ends - width + np.arange(width)[None, :]
        self._ij = (np.maximum(starts, 0), np.broadcast_to(ends, starts.shape))
        self._allowed = (starts >= 0) & ~self.forbidden[self._ij[0]] & ~self.forbidden[ends]
        self._times: dict[float, tuple[np.ndarray, np.ndarray]] = {}
        self._terms: tuple[np.ndarray, ...] | None = None
        self._reduce: np.ndarray | None = None
        # the memory cap binds only if the largest stage, kept without recompute at the
        # largest count, could exceed it; else every k sees the same costs
        self.binding = bool(np.isfinite(self.cap)) and bool(np.any(
            np.where(self._allowed, self._memory(max(self.stash), False), 0.0) > self.cap))
        self._cache: dict[tuple[int, bool, float], np.ndarray] = {}
        self._cache_size = max(1, 2**28 // (8 * (n + 1) * width))

    def widen(self, limit: float) -> None:
        """Widen the band until every stage left out costs more than ``limit``."""
        if self.covers <= limit:
            self._set_width(max(self._width_for(limit), self.width + 1))

    # -- costs -----------------------------------------------------------------------------

    def bandwidth(self, k: int, default: float = float("inf")) -> float:
        """The bandwidth stage k sends over (the last stage sends nothing)."""
        if self.bandwidths is None or k >= self.num_stages - 1:
            return default
        return float(self.bandwidths[k])

    def _send(self, bandwidth: float) -> np.ndarray:
        n, cut = self.n, self.cut
        send = cut / bandwidth if np.isfinite(bandwidth) else np.where(
            np.isfinite(cut), 0.0, np.inf)
        send = send.copy()
        send[n] = 0.0  # the last stage sends nothing on
        return send

    def times(self, bandwidth: float) -> tuple[np.ndarray, np.ndarray]:
        """(time, plain_time) of the band's stages sending what crosses j at ``bandwidth``:
        with recompute when it is on (or "auto"), and without (the last stage's)."""
        if bandwidth not in self._times:
            send = self._send(bandwidth)
            i, j = self._ij

            def stage_times(prefix: np.ndarray) -> np.ndarray:
                return np.where(self._allowed, prefix[j] - prefix[i] + send[j], np.inf)

            time = stage_times(self._prefix[False])
            self._times[bandwidth] = (time, time if self._plain is None
                                      else stage_times(self._prefix[True]))
        return self._times[bandwidth]

    def _memory(self, stash: float, recompute: bool) -> np.ndarray:
        """Peak bytes of the band's stages (``MemoryModel.matrix`` on the band): the terms
        that do not depend on the stash count are kept for the next call."""
        if self._terms is None:
            i, j = self._ij
            self._terms = (self.model.held(i, j), self.model.activations(i, j),
                           self.model.workspace(i, j), self.model.cut[i])
        held, activations, workspace, entering = self._terms
        peak = peak_bytes(held, entering, activations, workspace, stash, recompute)
        return np.where(self._allowed, peak, np.inf)  # (a band start is always below its end)

    def allreduce(self) -> np.ndarray:
        """Seconds of each band stage's all-reduce over its replicas."""
        assert self.reduces is not None
        if self._reduce is None:
            self._reduce = self.reduces(*self._ij)
        return self._reduce

    def at(self, k: int, i: int, j: int) -> float:
        """The cost of stage [i, j) as the k-th stage (it need not be in the band)."""
        if j - i > self.width:
            self.widen(self.covers)
            return self.at(k, i, j)
        return float(self.cost(k)[j, i - j + self.width])

    def weights(self) -> np.ndarray | None:
        """Per boundary, seconds per byte relative to the fastest (the partition's "fewest
        bytes" counts a byte over a slow link for more); None where every link is alike."""
        if self.bandwidths is None or len(set(self.bandwidths)) < 2:
            return None
        fastest = max(self.bandwidths)
        return np.asarray([fastest / b if np.isfinite(fastest) else 1.0
                           for b in self.bandwidths], dtype=np.float64)

    def recomputes(self, i: int, j: int, k: int) -> bool:
        """Whether stage [i, j) recomputes as the k-th stage."""
        if k == self.num_stages - 1 or self.mode is False:
            return False
        if self.mode is True:
            return True
        return bool(self.model.peak(i, j, self.stash[k], False) > self.cap)  # "auto"

    def memory(self, bounds: list[int]) -> tuple[float, ...]:
        flags = [self.recomputes(i, j, k) for k, (i, j) in enumerate(zip(bounds, bounds[1:]))]
        return tuple(float(x) for x in self.model.stages(bounds, self.stash, flags))

    def cost(self, k: int) -> np.ndarray:
        """[U + 1, width]: the cost of each band stage as the k-th stage; inf where it may
        not be, or does not fit."""
        last = k == self.num_stages - 1
        key = (self.stash[k] if self.binding else 0, last, self.bandwidth(k))
        if key not in self._cache:
            if len(self._cache) >= self._cache_size:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = self._cost(k, last)
        return self._cache[key]

    def _cost(self, k: int, last: bool) -> np.ndarray:
        n, stash = self.n, self.stash[k]
        time, plain_time = self.times(self.bandwidth(k, self.default_bandwidth))
        ends_at_n = self._ij[1] == n
        if last:  # only stages ending at N: without recompute, at the last stage's own count
            cost = np.where(ends_at_n, plain_time, np.inf)
            if self.binding:
                cost = np.where(self._memory(stash, False) <= self.cap, cost, np.inf)
            return cost
        if not self.binding:  # everything fits: "auto" recomputes nowhere
            chosen = plain_time if self.mode == "auto" else time
            return np.where(ends_at_n, np.inf, chosen)
        if self.mode == "auto":
            # each stage recomputes only if it does not fit otherwise, priced by its choice
            plain_memory = self._memory(stash, False)
            recomputes = plain_memory > self.cap
            time = np.where(recomputes, time, plain_time)
            memory = np.where(recomputes, self._memory(stash, True), plain_memory)
        else:
            memory = self._memory(stash, bool(self.mode))
        return np.where(ends_at_n | (memory > self.cap), np.inf, time)


def _prefix(values: np.ndarray) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])
