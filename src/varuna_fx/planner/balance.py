"""Fast balanced partitions for the search: bisection on the bottleneck with a greedy check.

``passes/partition.py`` is exact (dynamic programming, O(P·U²)) and runs once for the chosen
configuration; the search needs a partition for many (micro-batch size, P) pairs, up to P in the
hundreds. With stage cost ``compute[i:j] + send(j)`` and memory increasing in ``j``, the greedy
that makes every stage as long as the threshold allows is optimal for the bottleneck (starting a
stage later never hurts), so bisection on the threshold finds the minimal bottleneck in
O(log(1/tol) · P · log U) -- about a millisecond for P = 64. The memory model is the partition
pass's (weights where first read, the stage input per stashed micro-batch, one micro-batch's
activations); :class:`StagePlan` then adds what the search checks on top (copies of shared
weights, workspace).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .costs import Shared, UnitArrays

_TOLERANCE = 1e-4  # relative precision of the bottleneck


@dataclass
class StagePlan:
    """A partition evaluated at one micro-batch size: per-stage sums (``send_bytes``: per link)."""

    bounds: tuple[int, ...]  # unit positions, P + 1
    forward: np.ndarray  # no-grad forward (recomputing stages) -- seconds per micro-batch
    recompute: np.ndarray  # forward with autograd
    backward: np.ndarray
    send_bytes: np.ndarray  # [P - 1] bytes crossing link s per micro-batch
    input_bytes: np.ndarray  # bytes received per micro-batch (what a recomputing stage stashes)
    weights: np.ndarray  # bytes held: weights, gradients, optimizer state, buffers
    grads: np.ndarray  # gradient bytes (what data parallelism all-reduces)
    shared_grads: float  # gradient bytes of weights held by several stages (summed each step)
    activations: np.ndarray  # bytes one micro-batch leaves for the backward
    workspace: np.ndarray  # largest single activation: its gradient during the backward
    # the split backward's input-gradient and weight passes, when the profile measured them
    input_grad: np.ndarray | None = None
    weight_grad: np.ndarray | None = None

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def flags(self, recompute: bool | Sequence[bool]) -> np.ndarray:
        """Per stage: whether it recomputes (never the last stage)."""
        p = self.num_stages
        flags = np.full(p, bool(recompute)) if isinstance(recompute, (bool, np.bool_)) \
            else np.asarray([bool(r) for r in recompute], dtype=bool)
        flags[-1] = False
        return flags

    def compute(self, recompute: bool | Sequence[bool]) -> np.ndarray:
        """Busy time per micro-batch; the last stage never recomputes (and its forward keeps the
        autograd graph). ``recompute``: one flag for all, or one per stage."""
        return np.where(self.flags(recompute), self.forward + self.recompute + self.backward,
                        self.recompute + self.backward)

    def sim_forward(self, recompute: bool | Sequence[bool]) -> np.ndarray:
        return np.where(self.flags(recompute), self.forward, self.recompute)

    def memory(self, stash_counts: list[int], recompute: bool | Sequence[bool]) -> np.ndarray:
        """Peak bytes per stage with ``stash_counts[s]`` micro-batches in flight on stage s."""
        stash = np.asarray(stash_counts, dtype=float)
        replays = self.flags(recompute) if self.num_stages > 1 else np.zeros(1, dtype=bool)
        kept = np.where(replays, stash * self.input_bytes + self.activations,
                        stash * (self.input_bytes + self.activations))
        return self.weights + kept + self.workspace


class Balancer:
    """Prefix sums of one micro-batch size's unit costs, and partitions over them."""

    def __init__(self, units: UnitArrays, shared: list[Shared], bandwidth: float,
                 recompute: bool) -> None:
        self.units = units
        self.shared = shared
        self.recompute = recompute
        compute = units.forward + units.recompute + units.backward if recompute \
            else units.recompute + units.backward
        self.count = len(compute)
        self.prefix = np.concatenate([[0.0], np.cumsum(compute)])
        send = units.cut / bandwidth if np.isfinite(bandwidth) else np.zeros_like(units.cut)
        send[-1] = 0.0
        self.value = (self.prefix + send).tolist()  # cost of a stage ending at j: value[j] - C[i]
        # suffix minimum: the largest j with value[j] <= x is the largest j with suffix[j] <= x
        self.suffix = np.minimum.accumulate(np.asarray(self.value)[::-1])[::-1].tolist()
        self.weight_prefix = np.concatenate([[0.0], np.cumsum(units.weights)])
        self.act_prefix = np.concatenate([[0.0], np.cumsum(units.activations)])
        self.cut = units.cut.tolist()
        # the last stage never recomputes: it costs forward-with-autograd + backward
        last = units.recompute + units.backward
        self.last_prefix = np.concatenate([[0.0], np.cumsum(last)]).tolist()
        self.max_unit = float(last.max()) if len(last) else 0.0
        self.total = float(self.prefix[-1])
        self.last_total = float(self.last_prefix[-1])
        self._memory_lists: dict[int, list[float]] = {}

    def _memory_prefix(self, in_flight: int) -> list[float]:
        """M[j] with stage memory = M[j] - M[i] + (in_flight * cut[i] with recompute)."""
        if in_flight not in self._memory_lists:
            acts = self.act_prefix if self.recompute else in_flight * self.act_prefix
            self._memory_lists[in_flight] = (self.weight_prefix + acts).tolist()
        return self._memory_lists[in_flight]

    def lower_bound(self, stages: int) -> float:
        """No partition into ``stages`` has a smaller bottleneck (compute only; every unit
        priced as on the last stage, the cheapest place for it)."""
        return max(self.max_unit, self.last_total / stages)

    def greedy(self, threshold: float, stages: int, memory_cap: float,
               in_flight: int) -> list[int] | None:
        """Bounds of ``stages`` stages each costing <= threshold and fitting, or None."""
        n, value, suffix, prefix = self.count, self.value, self.suffix, self.prefix
        mem = self._memory_prefix(in_flight)
        stash = in_flight if self.recompute else 0
        bounds = [0]
        i = 0
        for k in range(stages):
            remaining = stages - k - 1
            if remaining == 0:  # the last stage, priced without recompute
                last_cost = self.last_prefix[n] - self.last_prefix[i]
                fits = mem[n] - mem[i] + stash * self.cut[i] <= memory_cap
                if last_cost > threshold or not fits or i >= n:
                    return None
                bounds.append(n)
                return bounds
            limit = prefix[i] + threshold
            j = min(bisect_right(suffix, limit) - 1, n - remaining,
                    bisect_right(mem, memory_cap + mem[i] - stash * self.cut[i]) - 1)
            while j > i and value[j] > limit:  # a costly send just before: end earlier
                j -= 1
            if j <= i or (remaining == 0 and j != n):
                return None
            bounds.append(j)
            i = j
        return bounds

    def partition(self, stages: int, memory_cap: float, in_flight: int) -> StagePlan | None:
        """Smallest-bottleneck partition (to 1e-4) that fits, or None if none fits."""
        if stages > self.count:
            return None
        hi = self.total + max(self.value[j] - self.prefix[j] for j in range(self.count + 1))
        best = self.greedy(hi, stages, memory_cap, in_flight)
        if best is None:
            return None
        lo = self.lower_bound(stages)
        while hi - lo > _TOLERANCE * hi:
            mid = 0.5 * (lo + hi)
            found = self.greedy(mid, stages, memory_cap, in_flight)
            if found is None:
                lo = mid
            else:
                hi, best = mid, found
        return self.stage_plan(self.balanced(hi, stages, memory_cap, in_flight) or best)

    def _reach(self, threshold: float, memory_cap: float, in_flight: int) -> list[int]:
        """For every start i, the farthest end of a stage costing <= threshold that fits."""
        n, value, suffix, prefix = self.count, self.value, self.suffix, self.prefix
        mem = self._memory_prefix(in_flight)
        stash = in_flight if self.recompute else 0
        reach = [0] * (n + 1)
        for i in range(n):
            limit = prefix[i] + threshold
            j = min(bisect_right(suffix, limit) - 1,
                    bisect_right(mem, memory_cap + mem[i] - stash * self.cut[i]) - 1)
            while j > i and value[j] > limit:
                j -= 1
            reach[i] = j
        return reach

    def balanced(self, threshold: float, stages: int, memory_cap: float,
                 in_flight: int) -> list[int] | None:
        """Bounds with the same bottleneck as the greedy's, but every stage near an equal
        share of the remaining work (the greedy packs the front and leaves the last stages
        nearly empty, which a simulation rightly charges as pipeline fill), each cut where
        the fewest bytes cross within half a share of its target (as the partition pass
        prefers cuts sending little)."""
        n, prefix = self.count, self.prefix.tolist()
        reach = self._reach(threshold, memory_cap, in_flight)
        need = [0.0] * (n + 1)  # fewest stages that cover [j, n): falls as j grows
        for j in range(n - 1, -1, -1):
            need[j] = 1 + need[reach[j]] if reach[j] > j else math.inf
        negated = [-x for x in need]
        cut = np.asarray(self.cut)
        bounds, i = [0], 0
        for k in range(stages - 1):
            left = stages - k - 1  # stages after this one
            lowest = max(i + 1, bisect_left(negated, -left))  # the rest still fits in `left`
            highest = min(reach[i], n - left)
            if lowest > highest or need[lowest] > left:
                return None
            share = (prefix[n] - prefix[i]) / (left + 1)
            lo = min(max(bisect_left(prefix, prefix[i] + share / 2), lowest), highest)
            hi = max(min(bisect_right(prefix, prefix[i] + 1.5 * share) - 1, highest), lo)
            j = lo + int(np.argmin(cut[lo:hi + 1]))
            bounds.append(j)
            i = j
        if reach[i] < n:
            return None
        return [*bounds, n]

    def min_memory_partition(self, stages: int, in_flight: int) -> StagePlan | None:
        """The partition whose largest stage (by the greedy's memory model) is smallest."""
        if stages > self.count:
            return None
        mem = self._memory_prefix(in_flight)
        lo, hi = 0.0, mem[-1] + in_flight * max(self.cut) + 1.0
        best = self.greedy(float("inf"), stages, hi, in_flight)
        while best is not None and hi - lo > _TOLERANCE * hi:
            mid = 0.5 * (lo + hi)
            found = self.greedy(float("inf"), stages, mid, in_flight)
            if found is None:
                lo = mid
            else:
                hi, best = mid, found
        return None if best is None else self.stage_plan(best)

    def stage_plan(self, bounds: list[int]) -> StagePlan:
        u = self.units
        starts = np.asarray(bounds[:-1])

        def per_stage(values: np.ndarray) -> np.ndarray:
            return np.add.reduceat(values, starts)

        weights, grads = per_stage(u.weights), per_stage(u.grads)
        shared_grads = 0.0
        node_starts = u.positions[starts]
        for item in self.shared:  # every reader beyond the first holds its own copy
            readers = np.unique(np.searchsorted(node_starts, item.nodes, side="right") - 1)
            weights[readers[1:]] += item.held
            grads[readers[1:]] += item.grad
            if len(readers) > 1:
                shared_grads += item.grad
        cut = np.asarray(self.cut)
        reseed = u.reseed * np.logical_or.reduceat(u.random, starts)  # per action, see costs
        return StagePlan(
            bounds=tuple(bounds),
            forward=per_stage(u.forward) + reseed,
            recompute=per_stage(u.recompute) + reseed,
            backward=per_stage(u.backward),
            send_bytes=cut[bounds[1:-1]],
            input_bytes=cut[starts],
            weights=weights,
            grads=grads,
            shared_grads=shared_grads,
            activations=per_stage(u.activations),
            workspace=np.maximum.reduceat(u.biggest, starts),
            input_grad=None if u.input_grad is None else per_stage(u.input_grad),
            weight_grad=None if u.weight_grad is None else per_stage(u.weight_grad),
        )
