"""The one memory model: the peak bytes of a pipeline stage, vectorised over stages.

The exact partition pass (``passes/partition.py``: every candidate stage ``[i, j)`` of its band
at once), the planner's fast partitioner (``planner/balance.py``: the farthest end of a stage
that fits) and the priced plan (one value per stage, the table's memory column and the
alternatives row) all call :class:`MemoryModel`, so the same stage of the same plan gets the
same bytes everywhere and a memory cap is checked with the numbers the plan prints.

A stage holds at its peak (:func:`peak_bytes`, the one formula):

* ``held``: the weights of the parameters it reads, counted on the stage that reads them first
  (weights, gradients and Adam's two moments for trainable ones, buffers once), plus its own
  copy of every shared (tied) weight whose first reader is on an earlier stage;
* ``workspace``: its largest single activation (that activation's gradient during the
  backward);
* per micro-batch in flight (``stash``: the schedule's peak count for that stage), the stage's
  input; and the activations autograd saves: for every micro-batch in flight without
  recompute, for the one micro-batch being replayed with recompute.

Sharded optimizer state (ZeRO-1, ``runtime/sync/zero.py``): each of a stage's D replicas keeps 1/D
of the optimizer's state, so a trainable weight of ``n`` bytes is held as ``n`` (weight) + ``n``
(gradient) + ``OPTIMIZER_COPIES * n / D`` (Adam's moments, in the parameters' own dtype, the
precision the runtime keeps them in): :func:`held_copies` is that factor, used wherever weight
bytes are counted (``assign_stages.partition_costs``, the planner's unit arrays).

Stages are ranges of *units* (nodes, or the runs of nodes between candidate cuts); every array
is per unit, ``cut`` per position (the bytes entering a stage that starts there).

An estimate from shapes: it leaves out the allocator's fragmentation, temporary buffers inside
an operation other than the largest activation's gradient, and communication buffers.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Integer byte counts summed in different orders differ by rounding only; the fast bounds in
# ``reach`` keep this much room so they never admit a stage the exact formula rejects.
_ROUNDING = 1e-9
# What a trainable weight costs in copies of its bytes: itself, its gradient, and the optimizer
# state (Adam's two moments), all in the parameters' dtype.
WEIGHT_COPIES = 4
OPTIMIZER_COPIES = 2


def held_copies(optimizer_shards: int = 1) -> float:
    """Copies of a trainable weight's bytes a stage holds when its optimizer state is split
    over ``optimizer_shards`` replicas (1: unsharded, 4 copies)."""
    return WEIGHT_COPIES - OPTIMIZER_COPIES + OPTIMIZER_COPIES / optimizer_shards


def sharded_held(held: np.ndarray, grads: np.ndarray, optimizer_shards: int) -> np.ndarray:
    """``held`` bytes (counted with :data:`WEIGHT_COPIES` per trainable weight, whose gradient
    bytes are ``grads``) with the optimizer state split over ``optimizer_shards`` replicas."""
    if optimizer_shards <= 1:
        return held
    return held - OPTIMIZER_COPIES * np.asarray(grads) * (1.0 - 1.0 / optimizer_shards)


@dataclass(frozen=True)
class SharedWeight:
    """A parameter or buffer read in several places (tied embeddings, ALBERT's one block)."""

    held: float  # bytes on every stage reading it (with gradient and optimizer state)
    grad: float  # gradient bytes (0 for buffers and frozen weights)
    nodes: np.ndarray  # sorted positions of the nodes (or units) reading it

    def sharded(self, optimizer_shards: int) -> SharedWeight:
        """The same weight with its optimizer state split over ``optimizer_shards``."""
        held = float(sharded_held(np.asarray(self.held), np.asarray(self.grad),
                                  optimizer_shards))
        return SharedWeight(held, self.grad, self.nodes)

    def in_units(self, positions: np.ndarray | Sequence[int]) -> SharedWeight:
        """The same weight with its readers given as units (``positions``: where each starts)."""
        units = np.searchsorted(np.asarray(positions), self.nodes, side="right") - 1
        return SharedWeight(self.held, self.grad, np.unique(units))


def peak_bytes(held: np.ndarray | float, input_bytes: np.ndarray | float,
               activations: np.ndarray | float, workspace: np.ndarray | float,
               stash: np.ndarray | float, recompute: np.ndarray | bool) -> np.ndarray:
    """Peak bytes of stages (every argument broadcasts): the one formula.

    It is linear in (held, input, activations, workspace), which ``MemoryModel.reach`` uses to
    bound it by prefix sums."""
    kept = np.where(recompute, 1, stash)  # micro-batches whose activations are kept at once
    return held + workspace + stash * np.asarray(input_bytes) + kept * np.asarray(activations)


class MemoryModel:
    """Peak bytes of any stage ``[i, j)`` of ``U`` units, with per-stage stash counts and
    recompute flags; ``i``/``j`` may be arrays (they broadcast)."""

    def __init__(self, weights: np.ndarray, activations: np.ndarray, cut: np.ndarray,
                 workspace: np.ndarray, shared: Sequence[SharedWeight] = ()) -> None:
        """``weights`` [U]: bytes held where first read; ``activations`` [U]: bytes one
        micro-batch leaves for the backward; ``cut`` [U + 1]: bytes crossing before each
        position (an infinite, forbidden cut is priced 0: no stage starts there);
        ``workspace`` [U]: the largest single activation; ``shared``: readers as units."""
        self.units = len(weights)
        self.weight_prefix = np.concatenate([[0.0], np.cumsum(weights, dtype=np.float64)])
        self.act_prefix = np.concatenate([[0.0], np.cumsum(activations, dtype=np.float64)])
        cut = np.asarray(cut, dtype=np.float64)
        self.cut = np.where(np.isfinite(cut), cut, 0.0)
        self.shared = [s for s in shared if len(s.nodes) > 1]  # one reader: nothing to copy
        self._first = np.array([s.nodes[0] for s in self.shared], dtype=np.int64)
        self._held = np.array([s.held for s in self.shared], dtype=np.float64)
        # sparse table for range maxima: level l holds max(workspace[u : u + 2**l])
        ws = np.asarray(workspace, dtype=np.float64)
        levels = [ws]
        while 2 ** len(levels) <= max(self.units, 1):
            prev, step = levels[-1], 2 ** (len(levels) - 1)
            levels.append(np.maximum(prev[:-step], prev[step:]))
        self._ranges = np.zeros((len(levels), max(self.units, 1)))
        for level, values in enumerate(levels):
            self._ranges[level, :len(values)] = values
        # the most the terms outside the prefix sums (workspace, shared copies) can add
        self.extra_bound = float(ws.max(initial=0.0) + self._held.sum())
        self._linear: dict[tuple[float, bool], tuple[list[float], list[float]]] = {}

    # -- the terms -------------------------------------------------------------------------

    def copies(self, i: np.ndarray | int, j: np.ndarray | int) -> np.ndarray:
        """[S, ...]: whether stage [i, j) holds its own copy of shared weight s (it reads it,
        and the weight's first reader is on an earlier stage)."""
        i, j = np.asarray(i), np.asarray(j)
        found = np.zeros((len(self.shared), *np.broadcast(i, j).shape), dtype=bool)
        for k, item in enumerate(self.shared):
            at = np.searchsorted(item.nodes, i, side="left")  # first reader at or after i
            nxt = np.append(item.nodes, self.units)[at]
            found[k] = (i > self._first[k]) & (nxt < j)
        return found

    def held(self, i: np.ndarray | int, j: np.ndarray | int) -> np.ndarray:
        own = self.weight_prefix[j] - self.weight_prefix[i]
        if not self.shared:
            return own
        return own + np.tensordot(self._held, self.copies(i, j), axes=1)

    def workspace(self, i: np.ndarray | int, j: np.ndarray | int) -> np.ndarray:
        i, j = np.broadcast_arrays(np.asarray(i), np.asarray(j))
        length = np.maximum(j - i, 1)
        level = np.floor(np.log2(length)).astype(np.int64)
        last = np.clip(j - (1 << level), 0, max(self.units - 1, 0))
        first = np.clip(i, 0, max(self.units - 1, 0))
        found = np.maximum(self._ranges[level, first], self._ranges[level, last])
        return np.where(j > i, found, 0.0)

    def activations(self, i: np.ndarray | int, j: np.ndarray | int) -> np.ndarray:
        return self.act_prefix[j] - self.act_prefix[i]

    # -- the peak ----------------------------------------------------------------------------

    def peak(self, i: np.ndarray | int, j: np.ndarray | int, stash: np.ndarray | float,
             recompute: np.ndarray | bool) -> np.ndarray:
        """Peak bytes of stages [i, j) holding ``stash`` micro-batches at once."""
        return peak_bytes(self.held(i, j), self.cut[i], self.activations(i, j),
                          self.workspace(i, j), stash, recompute)

    def stages(self, bounds: Sequence[int], stash: Sequence[int] | np.ndarray,
               recompute: Sequence[bool] | np.ndarray) -> np.ndarray:
        """Peak bytes of each stage of a partition (``bounds``: P + 1 unit positions)."""
        b = np.asarray(bounds, dtype=np.int64)
        return self.peak(b[:-1], b[1:], np.asarray(stash, dtype=np.float64),
                         np.asarray(recompute, dtype=bool))

    def reach(self, i: int, stash: float, recompute: bool, cap: float, end: int) -> int:
        """The largest j <= ``end`` such that stage [i, j) fits in ``cap`` (i if none does).

        The peak grows with j. Prefix sums bound it from below (weights, input and
        activations) and, with ``extra_bound``, from above, so two bisections settle most
        starts; the exact peak is evaluated only between the bounds."""
        if end <= i or cap == np.inf:
            return max(end, i)
        key = (float(stash), bool(recompute))
        if key not in self._linear:  # the formula is linear: apply it to the prefix sums
            self._linear[key] = (
                peak_bytes(self.weight_prefix, 0.0, self.act_prefix, 0.0, stash,
                           recompute).tolist(),
                peak_bytes(0.0, self.cut, 0.0, 0.0, stash, recompute).tolist())
        linear, entering = self._linear[key]
        base = linear[i] - entering[i]
        room = _ROUNDING * (abs(cap) + self.extra_bound)
        hi = min(end, bisect_right(linear, cap + base + room) - 1)
        if hi <= i:
            return i
        lo = min(hi, max(i, bisect_right(linear, cap - self.extra_bound - room + base) - 1))
        if lo == hi:
            return hi
        ends = np.arange(lo + 1, hi + 1)
        fits = self.peak(i, ends, stash, recompute) <= cap
        return hi if fits.all() else lo + int(np.argmin(fits))


def format_bytes(nbytes: float, up: bool = False) -> str:
    """Bytes for people, readable at every scale ("0.00 GiB" would hide a tiny memory, a typo
    in ``gpu_memory``): GiB and TiB with two decimals, MiB and KiB with one, else whole bytes.
    Every message and table that prints a size uses this one. ``up``: rounded up, for a size
    that must be enough ("devices with at least ...")."""
    return _format(nbytes, 0, up)


def _format(nbytes: float, more: int, up: bool = False) -> str:
    for unit, size, digits in (("TiB", 2**40, 2), ("GiB", 2**30, 2), ("MiB", 2**20, 1),
                               ("KiB", 2**10, 1), ("bytes", 1, 0)):
        if abs(nbytes) >= size or unit == "bytes":
            scale = 10 ** (digits + more)
            # (less a hair: 3.0 MiB exactly must not round up to 3.1)
            value = math.ceil(nbytes / size * scale - 1e-9) / scale if up else nbytes / size
            return f"{value:.{digits + more}f} {unit}"
    raise AssertionError("unreachable")


def format_bytes_apart(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` as :func:`format_bytes` writes them, and where that reads the same for
    two different sizes (a memory, and what is needed beyond it: "fits in 2.0 MiB ... needs
    2.0 MiB"), with more digits and the bytes themselves."""
    shown = format_bytes(a), format_bytes(b)
    if shown[0] != shown[1] or a == b:
        return shown
    for more in (1, 2, 3):
        if _format(a, more) != _format(b, more):
            break
    exact = 0 if round(a) != round(b) else 1 if round(a, 1) != round(b, 1) else 3
    return (f"{_format(a, more)} ({a:,.{exact}f} bytes)", f"{_format(b, more)} ({b:,.{exact}f} bytes)")
