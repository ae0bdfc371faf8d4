"""Fast balanced partitions for the search: bisection on the bottleneck with a greedy check.

``passes/partition.py`` is exact (dynamic programming, O(P·U·band)) and runs once for the chosen
configuration; the search needs a partition for many (micro-batch size, P) pairs, up to P in the
hundreds. With stage cost ``compute[i:j] + send(j)`` increasing in ``j``, the greedy that makes
every stage as long as the threshold allows is optimal for the bottleneck without a memory cap
(starting a stage later never hurts), so bisection on the threshold finds the minimal bottleneck
in O(log(1/tol) · P · log U) -- about a millisecond for P = 64. Memory is the package's one
model (``costs/memory.py``), at each stage's own stash count: a stage ends where it stops
fitting (``MemoryModel.reach``), so :class:`PartitionCosts` prices exactly what the partition was
checked with (a starting point that shifts a stage's input or shared-weight copies makes the
greedy a heuristic under a binding cap; the exact pass then makes the final partition).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..costs.memory import _ROUNDING, MemoryModel, SharedWeight, peak_bytes
from .cost_table import UnitArrays

_TOLERANCE = 1e-4  # relative precision of the bottleneck


@dataclass
class PartitionCosts:
    """A partition (``bounds``) and its per-stage costs at one micro-batch size (``send_bytes``:
    per link). Not a :class:`~varuna_fx.planner.plan.Plan`: the search prices many of these."""

    bounds: tuple[int, ...]  # unit positions, P + 1
    forward: np.ndarray  # no-grad forward (recomputing stages) -- seconds per micro-batch
    recompute: np.ndarray  # forward with autograd
    backward: np.ndarray
    send_bytes: np.ndarray  # [P - 1] bytes crossing link s per micro-batch
    input_bytes: np.ndarray  # bytes received per micro-batch (what a recomputing stage stashes)
    weights: np.ndarray  # bytes held: weights, gradients, optimizer state, buffers, copies
    grads: np.ndarray  # gradient bytes (what data parallelism all-reduces)
    shared_grads: float  # gradient bytes of weights held by several stages (summed each step)
    activations: np.ndarray  # bytes one micro-batch leaves for the backward
    workspace: np.ndarray  # largest single activation: its gradient during the backward
    # the split backward's input-gradient and weight passes, when the profile measured them
    input_grad: np.ndarray | None = None
    weight_grad: np.ndarray | None = None
    # per weight held by several stages: (its gradient bytes, the stages holding a copy)
    shared_holders: tuple[tuple[float, tuple[int, ...]], ...] = ()

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

    def memory(self, stash_counts: Sequence[int], recompute: bool | Sequence[bool]
               ) -> np.ndarray:
        """Peak bytes per stage with ``stash_counts[s]`` micro-batches in flight on stage s
        (``costs.memory.peak_bytes`` of this plan's per-stage terms)."""
        return peak_bytes(self.weights, self.input_bytes, self.activations, self.workspace,
                          np.asarray(stash_counts, dtype=float), self.flags(recompute))


class Balancer:
    """Prefix sums of one micro-batch size's unit costs, and partitions over them."""

    def __init__(self, units: UnitArrays, shared: Sequence[SharedWeight], bandwidth: float,
                 recompute: bool) -> None:
        self.units = units
        self.recompute = recompute
        self.model = MemoryModel(units.weights, units.activations, units.cut, units.workspace,
                                 [item.in_units(units.positions) for item in shared])
        compute = units.forward + units.recompute + units.backward if recompute \
            else units.recompute + units.backward
        self.count = len(compute)
        self.prefix = np.concatenate([[0.0], np.cumsum(compute)])
        self.bandwidth = bandwidth
        # per bandwidth a stage may send over: (value, suffix, their arrays), see _sending
        self._sends: dict[float, tuple[list[float], list[float], np.ndarray, np.ndarray]] = {}
        self.value, self.suffix, self._values, self._suffix = self._sending(bandwidth)
        self.cut = units.cut.tolist()
        # the last stage never recomputes: it costs forward-with-autograd + backward
        last = units.recompute + units.backward
        self.last_prefix = np.concatenate([[0.0], np.cumsum(last)]).tolist()
        self.max_unit = float(last.max()) if len(last) else 0.0
        self.total = float(self.prefix[-1])
        self.last_total = float(self.last_prefix[-1])
        self._prefix = self.prefix.tolist()  # (list indexing: the greedy's inner loop)
        # Where a stage starting at i stops fitting does not depend on the threshold the
        # bisection tries, so it is found once per (stash count, memory cap) for every start
        # instead of once per greedy step (10^5 calls per search). Exact when the peak grows
        # with the stage's end (nonnegative bytes, as cost_table.py fits them), so that the
        # farthest fitting end below any limit is min(limit, the farthest overall);
        # otherwise every step asks the model, as it always did.
        self._monotone = all(bool(np.all(np.asarray(a) >= 0)) for a in (
            units.weights, units.activations, units.workspace, units.cut))
        self._fitting: dict[tuple[int, float], list[int]] = {}

    def _sending(self, bandwidth: float
                 ) -> tuple[list[float], list[float], np.ndarray, np.ndarray]:
        """For stages sending over ``bandwidth``: ``value[j]``, the cost of a stage ending at
        j less the compute before its start (``value[j] - prefix[i]``), and its suffix
        minimum (the largest j with value[j] <= x is the largest j with suffix[j] <= x), as
        lists (the greedy's inner loop indexes them) and arrays."""
        if bandwidth not in self._sends:
            cut = self.units.cut
            send = cut / bandwidth if np.isfinite(bandwidth) else np.zeros_like(cut)
            send[-1] = 0.0
            values = self.prefix + send
            suffix = np.minimum.accumulate(values[::-1])[::-1]
            self._sends[bandwidth] = (values.tolist(), suffix.tolist(), values, suffix)
        return self._sends[bandwidth]

    def _link(self, bandwidths: Sequence[float] | None, k: int) -> float:
        """The bandwidth stage k sends over (``bandwidths``: per boundary, or None: one)."""
        if bandwidths is None or k >= len(bandwidths):
            return self.bandwidth
        return float(bandwidths[k])

    def lower_bound(self, stages: int) -> float:
        """No partition into ``stages`` has a smaller bottleneck (compute only; every unit
        priced as on the last stage, the cheapest place for it)."""
        return max(self.max_unit, self.last_total / stages)

    def _fits_last(self, i: int, memory_cap: float, stash: int) -> bool:
        """Whether [i, N) fits as the last stage (no recompute, its own stash count)."""
        return self.model.reach(i, stash, False, memory_cap, self.count) == self.count

    def _fitting_ends(self, memory_cap: float, stash: int) -> list[int] | None:
        """For every start i, the farthest end of a stage (not the last) that fits holding
        ``stash`` micro-batches, i if none does; None where the peak may not grow with the
        end (see ``__init__``)."""
        if not self._monotone:
            return None
        key = (stash, memory_cap)
        if key not in self._fitting:
            self._fitting[key] = self._reach_all(stash, memory_cap) + [self.count]
        return self._fitting[key]

    def _reach_all(self, stash: int, cap: float) -> list[int]:
        """``[model.reach(i, stash, recompute, cap, U) for i in range(U)]`` with every start
        at once: the same bisections of the same prefix sums (``np.searchsorted`` is
        ``bisect_right``), then the exact peaks of every start's undecided ends in one call
        of ``model.peak`` (the same elementwise formula, so the same comparisons). A
        memory-tight search asks for a few dozen (stash count, cap) pairs, each a Python
        loop over 10^3 starts before."""
        model, n = self.model, self.count
        if n == 0:
            return []
        if cap == np.inf:
            return [n] * n
        linear = peak_bytes(model.weight_prefix, 0.0, model.act_prefix, 0.0, float(stash),
                            self.recompute)
        entering = peak_bytes(0.0, model.cut, 0.0, 0.0, float(stash), self.recompute)
        starts = np.arange(n)
        base = linear[:n] - entering[:n]
        room = _ROUNDING * (abs(cap) + model.extra_bound)  # (as reach leaves it)
        hi = np.minimum(n, np.searchsorted(linear, cap + base + room, side="right") - 1)
        lo = np.minimum(hi, np.maximum(
            starts, np.searchsorted(linear, cap - model.extra_bound - room + base,
                                    side="right") - 1))
        found = np.where(hi <= starts, starts, hi)
        open_ = np.flatnonzero((hi > starts) & (lo < hi))
        if len(open_):
            widths = hi[open_] - lo[open_]
            first = np.repeat(open_, widths)
            offsets = np.arange(int(widths.sum())) - np.repeat(np.cumsum(widths) - widths,
                                                                widths)
            ends = np.repeat(lo[open_] + 1, widths) + offsets
            fits = model.peak(first, ends, float(stash), self.recompute) <= cap
            at = 0
            for i, width in zip(open_.tolist(), widths.tolist()):
                chunk = fits[at:at + width]
                at += width
                found[i] = hi[i] if chunk.all() else lo[i] + int(np.argmin(chunk))
        return found.tolist()

    def _end(self, i: int, threshold: float, memory_cap: float, stash: int,
             latest: int, bandwidth: float | None = None) -> int:
        """The farthest end (<= latest) of a stage starting at i that costs <= threshold and
        fits holding ``stash`` micro-batches (i if none), sending over ``bandwidth``
        (default: the balancer's one)."""
        value, suffix, _, _ = self._sending(self.bandwidth if bandwidth is None else bandwidth)
        limit = self._prefix[i] + threshold
        j = min(bisect_right(suffix, limit) - 1, latest)
        fitting = self._fitting_ends(memory_cap, stash)
        if fitting is None:
            j = self.model.reach(i, stash, self.recompute, memory_cap, j)
        else:  # what reach(i, ..., j) answers: the peak grows with j
            j = min(j, fitting[i]) if j > i else i
        while j > i and value[j] > limit:  # a costly send just before: end earlier
            j -= 1
        return j

    def greedy(self, threshold: float, stages: int, memory_cap: float,
               stash_counts: Sequence[int],
               bandwidths: Sequence[float] | None = None) -> list[int] | None:
        """Bounds of ``stages`` stages each costing <= threshold and fitting, or None.
        ``bandwidths``: per boundary, the link stage k sends over (None: the balancer's)."""
        n = self.count
        bounds = [0]
        i = 0
        prefix, suffix, value = self._prefix, self.suffix, self.value
        for k in range(stages - 1):
            if bandwidths is not None:
                value, suffix, _, _ = self._sending(self._link(bandwidths, k))
            fitting = self._fitting_ends(memory_cap, stash_counts[k])
            if fitting is None:
                j = self._end(i, threshold, memory_cap, stash_counts[k], n - (stages - k - 1),
                              self._link(bandwidths, k))
            else:  # ``_end``, inlined: the bisection's inner loop (10^5 steps per search)
                limit = prefix[i] + threshold
                j = min(bisect_right(suffix, limit) - 1, n - (stages - k - 1), fitting[i])
                while j > i and value[j] > limit:
                    j -= 1
            if j <= i:
                return None
            bounds.append(j)
            i = j
        # the last stage, priced without recompute
        if self.last_prefix[n] - self.last_prefix[i] > threshold or i >= n or \
                not self._fits_last(i, memory_cap, stash_counts[-1]):
            return None
        return [*bounds, n]

    def partition(self, stages: int, memory_cap: float,
                  stash_counts: int | Sequence[int],
                  bandwidths: Sequence[float] | None = None) -> PartitionCosts | None:
        """Smallest-bottleneck partition (to 1e-4) that fits, or None if none fits.
        ``stash_counts``: micro-batches each stage holds at once (one for all, or per stage).
        ``bandwidths``: per boundary (P - 1), the link each stage sends over, where links
        differ (None: the balancer's one bandwidth)."""
        if stages > self.count:
            return None
        if isinstance(stash_counts, int):
            stash_counts = (stash_counts,) * stages
        if bandwidths is not None and len(set(bandwidths)) < 2:  # one link: as before
            bandwidths, slowest = None, (bandwidths[0] if bandwidths else self.bandwidth)
            if slowest != self.bandwidth:
                bandwidths = [slowest] * (stages - 1)
        slow = min(bandwidths) if bandwidths else self.bandwidth
        value = self._sending(slow)[0]
        hi = self.total + max(value[j] - self.prefix[j] for j in range(self.count + 1))
        best = self.greedy(hi, stages, memory_cap, stash_counts, bandwidths)
        if best is None:
            return None
        lo = self.lower_bound(stages)
        while hi - lo > _TOLERANCE * hi:
            mid = 0.5 * (lo + hi)
            found = self.greedy(mid, stages, memory_cap, stash_counts, bandwidths)
            if found is None:
                lo = mid
            else:
                hi, best = mid, found
        return self.partition_costs(
            self.balanced(hi, stages, memory_cap, stash_counts, bandwidths) or best)

    def _reach(self, threshold: float, memory_cap: float, stash: int) -> list[int]:
        """For every start i, the farthest end of a stage costing <= threshold that fits as a
        stage holding ``stash`` micro-batches (not the last one)."""
        n = self.count
        fitting = self._fitting_ends(memory_cap, stash)
        if fitting is None:
            return [self._end(i, threshold, memory_cap, stash, n) for i in range(n)] + [0]
        # ``_end`` for every start at once (same comparisons on the same floats)
        starts = np.arange(n)
        limit = self.prefix[:n] + threshold
        ends = np.minimum(np.searchsorted(self._suffix, limit, side="right") - 1, n)
        ends = np.where(ends > starts, np.minimum(ends, fitting[:n]), starts)
        found = ends.tolist()
        for i in np.flatnonzero((ends > starts) & (self._values[ends] > limit)).tolist():
            j, bound = found[i], limit[i]
            while j > i and self.value[j] > bound:  # a costly send just before
                j -= 1
            found[i] = j
        return [*found, 0]

    def balanced(self, threshold: float, stages: int, memory_cap: float,
                 stash_counts: Sequence[int],
                 bandwidths: Sequence[float] | None = None) -> list[int] | None:
        """Bounds with the same bottleneck as the greedy's, but every stage near an equal
        share of the remaining work (the greedy packs the front and leaves the last stages
        nearly empty, which a simulation rightly charges as pipeline fill), each cut where
        the fewest bytes cross within half a share of its target (as the partition pass
        prefers cuts sending little). Whether the rest still fits is judged at the largest
        stash count of the stages before the last (memory grows with it); every stage is
        then checked at its own. ``bandwidths`` (per boundary): each stage's own end is found
        at its link's send time; whether the rest still fits is judged at the balancer's one
        bandwidth (an optimistic judgement falls back to the greedy's bounds)."""
        n, prefix = self.count, self.prefix.tolist()
        most = max(stash_counts[:-1], default=stash_counts[-1])
        reach = self._reach(threshold, memory_cap, most)
        need = [0.0] * (n + 1)  # fewest stages that cover [j, n): falls as j grows
        for j in range(n - 1, -1, -1):
            need[j] = 1 + need[reach[j]] if reach[j] > j else math.inf
        negated = [-x for x in need]
        cut = np.asarray(self.cut)
        bounds, i = [0], 0
        for k in range(stages - 1):
            left = stages - k - 1  # stages after this one
            lowest = max(i + 1, bisect_left(negated, -left))  # the rest still fits in `left`
            link = self._link(bandwidths, k)
            own = reach[i] if stash_counts[k] == most and link == self.bandwidth else \
                self._end(i, threshold, memory_cap, stash_counts[k], n, link)
            highest = min(own, n - left)
            if lowest > highest or need[lowest] > left:
                return None
            share = (prefix[n] - prefix[i]) / (left + 1)
            lo = min(max(bisect_left(prefix, prefix[i] + share / 2), lowest), highest)
            hi = max(min(bisect_right(prefix, prefix[i] + 1.5 * share) - 1, highest), lo)
            j = lo + int(np.argmin(cut[lo:hi + 1]))
            bounds.append(j)
            i = j
        if reach[i] < n or not self._fits_last(i, memory_cap, stash_counts[-1]):
            return None
        return [*bounds, n]

    def min_memory_partition(self, stages: int,
                             stash_counts: int | Sequence[int]) -> PartitionCosts | None:
        """The partition whose largest stage is smallest (to 1e-4, as the greedy finds it)."""
        if stages > self.count:
            return None
        if isinstance(stash_counts, int):
            stash_counts = (stash_counts,) * stages
        most = max(stash_counts)
        lo = 0.0
        hi = float(self.model.peak(0, self.count, most, False)) + most * max(self.cut) + 1.0
        best = self.greedy(float("inf"), stages, hi, stash_counts)
        while best is not None and hi - lo > _TOLERANCE * hi:
            mid = 0.5 * (lo + hi)
            found = self.greedy(float("inf"), stages, mid, stash_counts)
            if found is None:
                lo = mid
            else:
                hi, best = mid, found
        return None if best is None else self.partition_costs(best)

    def partition_costs(self, bounds: list[int]) -> PartitionCosts:
        u = self.units
        starts = np.asarray(bounds[:-1])
        ends = np.asarray(bounds[1:])

        def per_stage(values: np.ndarray) -> np.ndarray:
            return np.add.reduceat(values, starts)

        # every reader beyond the first stage holds its own copy, and sums its gradient
        copies = self.model.copies(starts, ends)
        grads = per_stage(u.grads)
        shared_grads = 0.0
        holders = []
        for item, held_by in zip(self.model.shared, copies):
            grads[held_by] += item.grad
            if held_by.any():
                shared_grads += item.grad
                first = int(np.searchsorted(starts, item.nodes[0], side="right") - 1)
                holders.append((item.grad, tuple(sorted({first, *np.flatnonzero(held_by)}))))
        cut = np.asarray(self.cut)
        reseed = u.reseed * np.logical_or.reduceat(u.random, starts)  # per action, see costs
        act = u.action  # every action's fixed cost (planner/machine.py), once per stage
        return PartitionCosts(
            bounds=tuple(bounds),
            forward=per_stage(u.forward) + reseed + act,
            recompute=per_stage(u.recompute) + reseed + act,
            backward=per_stage(u.backward) + act,
            send_bytes=cut[bounds[1:-1]],
            input_bytes=cut[starts],
            weights=self.model.held(starts, ends),
            grads=grads,
            shared_grads=shared_grads,
            activations=self.model.activations(starts, ends),
            workspace=self.model.workspace(starts, ends),
            input_grad=None if u.input_grad is None else per_stage(u.input_grad) + act,
            weight_grad=None if u.weight_grad is None else per_stage(u.weight_grad) + act,
            shared_holders=tuple((g, tuple(int(x) for x in h)) for g, h in holders),
        )
