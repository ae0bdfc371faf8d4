"""Per-node costs of an annotated graph as numpy arrays, cheap to evaluate at any micro-batch size.

The search weighs thousands of (P, D, micro-batch) candidates, so it needs every node's forward,
recompute and backward time, weights, activations and the bytes crossing every cut at many
micro-batch sizes. All of them are affine in ``b`` (times: a roofline max of affine terms), so
:class:`CostTable` keeps the coefficients and evaluates whole arrays at once. Weights,
activations and cut bytes come from ``assign_stages.partition_problem`` itself (fitted from two
sizes), so the planner and the partition pass cannot disagree about them.

Nodes are grouped into *units* between the cut positions worth considering (allowed cuts, one per
run of free nodes -- the same reduction the partitioner makes), which shrinks the arrays
several-fold (bench/RESULTS.md, "Figures the code cites").
Measured profiles replace the time estimates through :class:`MeasuredTimes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch.fx as fx

from ..costs.memory import SharedWeight
from ..costs.roofline import DeviceSpec
from ..ir.nodes import info
from ..passes.assign_stages import CostSetting, compute_nodes, params_read, trainable_names
from ..passes.assign_stages import partition_problem as _partition_problem
from ..passes.partition import candidate_cuts, free_nodes


def _coefficients(values: list[Any]) -> np.ndarray:
    """Affines -> a [2, N] array of (const, per_sample)."""
    return np.array([[a.const for a in values], [a.per_sample for a in values]], dtype=float)


def _at(coef: np.ndarray, b: float) -> np.ndarray:
    return coef[0] + coef[1] * b


@dataclass
class NodeArrays:
    """Costs of one micro-batch of size ``b``, one entry per compute node."""

    forward: np.ndarray  # seconds, forward without autograd (what recomputing stages run first)
    recompute: np.ndarray  # seconds, forward with autograd (recompute, or a stashing forward)
    backward: np.ndarray
    activations: np.ndarray  # bytes left for the backward
    # measured split backward (None: not measured): the input-gradient pass and the weight
    # pass of a split-backward schedule, together more than ``backward``
    input_grad: np.ndarray | None = None
    weight_grad: np.ndarray | None = None


def interpolate(sizes: np.ndarray, values: np.ndarray, b: float) -> np.ndarray:
    """``values`` [K, S] measured at ``sizes`` [S] (ascending), at micro-batch size ``b``:
    linear between the two measured sizes around ``b``; above the largest measured size in
    proportion to it (the largest size's per-sample time), below the smallest along the first
    segment.

    Why not one ``const + per_sample * b`` line over all sizes: on a CPU a matmul with a few
    rows runs at a fraction of its large-batch speed, so the per-sample slope of small sizes
    overstates large ones. Why not the last segment's slope above the range: it is the
    difference of two noisy samples, multiplied by the distance, so timing noise at two sizes
    became a large error far above them; in proportion, the error stays the largest sample's
    own. (The runs: bench/RESULTS.md, "Figures the code cites".)"""
    if len(sizes) == 1 or b >= sizes[-1]:
        return values[:, -1] * (b / sizes[-1])
    j = int(np.clip(np.searchsorted(sizes, b, side="right") - 1, 0, len(sizes) - 2))
    lo, hi = values[:, j], values[:, j + 1]
    return np.maximum(lo + (hi - lo) * ((b - sizes[j]) / (sizes[j + 1] - sizes[j])), 0.0)


def monotone(values: np.ndarray) -> np.ndarray:
    """The closest non-decreasing sequence along the last axis (pool adjacent violators): a
    bigger micro-batch never takes less time, so a sample below its smaller neighbour is
    noise, averaged with it rather than followed."""
    out = np.array(values, dtype=float)
    for row in out.reshape(-1, out.shape[-1]):
        blocks: list[list[float]] = []  # [mean, count]
        for v in row:
            blocks.append([float(v), 1.0])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                (m2, c2), (m1, c1) = blocks[-2], blocks.pop()
                blocks[-1] = [(m2 * c2 + m1 * c1) / (c2 + c1), c2 + c1]
        row[:] = [m for m, c in blocks for _ in range(int(c))]
    return out


class PerNodeTimes:
    """``costs.roofline.NodeTimes`` from per-node arrays: a subclass gives ``names`` (the
    graph's nodes in order) and ``arrays(b)`` at micro-batch size ``b``; the partition pass's
    two questions are read from them by node name (``MeasuredTimes`` from a profile,
    ``machine.CalibratedTimes`` from this machine's costs)."""

    names: list[str]

    def arrays(self, b: int) -> NodeArrays:
        raise NotImplementedError

    def _select(self, nodes: Sequence[Any], values: np.ndarray) -> np.ndarray:
        index = {name: i for i, name in enumerate(self.names)}
        return values[[index[n.name] for n in nodes]]

    def step_times(self, nodes: Sequence[Any], batch: int, recompute: bool) -> np.ndarray:
        a = self.arrays(batch)
        total = a.forward + a.recompute + a.backward if recompute else a.recompute + a.backward
        return self._select(nodes, total)

    def activation_bytes(self, nodes: Sequence[Any], batch: int) -> np.ndarray:
        return self._select(nodes, self.arrays(batch).activations)


@dataclass
class MeasuredTimes(PerNodeTimes):
    """Chunk-level measurements spread over the chunk's nodes in proportion to their estimates.

    Implements ``costs.roofline.NodeTimes`` so the partition pass can use it. ``fwd``/``rec``/``bwd``/
    ``mem`` are [K, 2] arrays of (const, per_sample) per chunk. With ``sizes`` and ``samples``
    ([K, S, 3]: forward, recompute, backward seconds at each measured size) times come from the
    measurements themselves (:func:`interpolate`); memory, exactly affine, from its fit.
    """

    names: list[str]
    chunk_of: np.ndarray  # [N] chunk of every compute node
    fwd: np.ndarray
    rec: np.ndarray
    bwd: np.ndarray
    mem: np.ndarray
    estimate: Any = field(repr=False)  # b -> NodeArrays with the local device's estimates
    reseed: float = 0.0  # seconds per forward/recompute of a stage with random ops
    sizes: np.ndarray | None = None
    samples: np.ndarray | None = None  # [K, S, 3 or 5]: F, R, B (and I, W) per chunk and size
    # the machine's terms a chunk's time leaves out (planner/machine.py): seconds of fixed
    # cost per stage action, and how much slower compute runs with the run's ranks sharing
    # the cores than with the profile's
    action: float = 0.0
    scale: float = 1.0
    variation: float = 0.0  # the profile's relative spread of repeated timings (Profile.spread)
    # seconds a step spends outside its actions (learned.py: learned from the first steps,
    # or estimated), and the key it is learned under (None: nothing is learned)
    step: float = 0.0
    learn_key: str | None = None

    def arrays(self, b: int) -> NodeArrays:
        est = self.estimate(b)
        k = len(self.fwd)
        at = None if self.samples is None or self.sizes is None else \
            [interpolate(self.sizes, self.samples[:, :, i], b)
             for i in range(self.samples.shape[2])]

        def spread(chunk: np.ndarray | int, weight: np.ndarray) -> np.ndarray:
            if isinstance(chunk, int):  # index into the samples: F, R, B, I, W
                assert at is not None
                measured = at[chunk]
            else:
                measured = np.maximum(chunk[:, 0] + chunk[:, 1] * b, 0.0)
            total = np.bincount(self.chunk_of, weights=weight, minlength=k)
            count = np.bincount(self.chunk_of, minlength=k)
            # a chunk whose estimate is zero (rare: all free nodes) spreads evenly
            share = np.where(total[self.chunk_of] > 0,
                             weight / np.where(total > 0, total, 1.0)[self.chunk_of],
                             1.0 / np.maximum(count, 1)[self.chunk_of])
            return measured[self.chunk_of] * share

        times = (0, 1, 2) if at is not None else (self.fwd, self.rec, self.bwd)
        split = at is not None and len(at) == 5
        scale = self.scale  # ranks sharing the cores (times only, never bytes)
        return NodeArrays(spread(times[0], est.forward) * scale,
                          spread(times[1], est.forward) * scale,
                          spread(times[2], est.backward) * scale,
                          spread(self.mem, est.activations),
                          spread(3, est.backward) * scale if split else None,
                          spread(4, est.backward) * scale if split else None)



@dataclass
class CostTable:
    """Everything the search needs about one annotated graph, as coefficient arrays."""

    names: list[str]
    fwd_flops: np.ndarray  # [2, N]
    bwd_flops: np.ndarray
    moved: np.ndarray  # bytes read + written
    weights: np.ndarray  # [N] bytes (weights + grads + Adam), where first read
    activations: np.ndarray  # [2, N]
    workspace: np.ndarray  # [2, N] the node's largest single activation (costs/memory.py)
    cut: np.ndarray  # [2, N + 1] bytes crossing the cut before node j
    allowed: np.ndarray  # [N + 1] bool: only tensors cross there
    random: np.ndarray  # [N] bool: dropout & co (the runtime re-seeds around such stages)
    units: np.ndarray  # cut positions worth considering, 0 .. N
    grads: np.ndarray  # [N] gradient bytes, where first read
    shared: tuple[SharedWeight, ...]  # weights read by several nodes
    # measured costs (a profile's MeasuredTimes, or machine.CalibratedTimes: the machine's
    # numbers for the graph's FLOPs and bytes); None: the device spec's roofline
    measured: MeasuredTimes | Any | None = None
    # buffers forward writes: (first, last) node using each (PartitionProblem.written_spans),
    # named when the cuts they forbid leave too few units for the stages asked for
    written_spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    # the trainable parameters' shapes, each once: what PowerSGD's price reads (costs/wire.py)
    parameter_shapes: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def build(cls, gm: fx.GraphModule) -> CostTable:
        nodes = compute_nodes(gm)
        metas = [info(n) for n in nodes]
        pc = [_partition_problem(gm, CostSetting(b, DeviceSpec("x", 1.0, 1.0), 1.0,
                                               float("inf"), 1, True)) for b in (1, 2)]
        allowed = np.isfinite(pc[0].cut_bytes)

        def affine(values: list[np.ndarray]) -> np.ndarray:  # [2, N] from sizes 1 and 2
            return np.stack([2 * values[0] - values[1], values[1] - values[0]])

        workspace = [p.workspace_bytes for p in pc]
        assert workspace[0] is not None and workspace[1] is not None
        table = cls(
            names=[n.name for n in nodes],
            fwd_flops=_coefficients([m.fwd_flops for m in metas]),
            bwd_flops=_coefficients([m.bwd_flops for m in metas]),
            moved=_coefficients([m.in_bytes + m.out_bytes for m in metas]),
            weights=np.asarray(pc[0].weight_bytes, dtype=float),
            activations=affine([p.activation_bytes for p in pc]),
            workspace=affine(workspace),
            cut=affine([np.where(allowed, p.cut_bytes, 0.0) for p in pc]),
            allowed=allowed,
            random=np.array([m.random for m in metas], dtype=bool),
            units=np.zeros(0, dtype=np.int64),
            grads=_gradient_bytes(nodes, trainable_names(gm)),
            shared=pc[0].shared,
            written_spans=dict(pc[0].written_spans),
            parameter_shapes=tuple(tuple(p.shape) for p in gm.parameters() if p.requires_grad),
        )
        table.units = table._candidate_cuts()
        return table

    @property
    def num_units(self) -> int:
        return len(self.units) - 1

    def _candidate_cuts(self) -> np.ndarray:
        """Allowed cuts, keeping of each run separated only by free nodes (``free_nodes``) the
        cut sending the fewest bytes: ``partition.candidate_cuts``."""
        flops = (self.fwd_flops != 0).any(0) | (self.bwd_flops != 0).any(0)
        free = free_nodes(flops, self.weights, (self.activations != 0).any(0),
                          (self.workspace != 0).any(0), self.shared)
        size = np.where(self.allowed, self.cut[0] + self.cut[1], np.inf)
        return np.array(candidate_cuts(free, size), dtype=np.int64)

    def estimate(self, b: float, spec: DeviceSpec) -> NodeArrays:
        """Roofline estimates, exactly as ``roofline.forward_time``/``backward_time``."""
        ff, bf, mv = _at(self.fwd_flops, b), _at(self.bwd_flops, b), _at(self.moved, b)
        fwd = np.where(ff > 0, np.maximum(ff / spec.flops, mv / spec.memory_bandwidth), 0.0)
        bwd = np.where(bf > 0, np.maximum(bf / spec.flops, 2 * mv / spec.memory_bandwidth), 0.0)
        return NodeArrays(fwd, fwd, bwd, _at(self.activations, b))

    def node_arrays(self, b: int, spec: DeviceSpec) -> NodeArrays:
        """Measured costs when the table has a profile, estimates for ``spec`` otherwise."""
        if self.measured is not None:
            return self.measured.arrays(b)
        return self.estimate(b, spec)

    def unit_arrays(self, b: int, spec: DeviceSpec,
                    positions: np.ndarray | None = None) -> UnitArrays:
        """Costs summed over the units between ``positions`` (default: the candidate cuts)."""
        positions = self.units if positions is None else np.asarray(positions, dtype=np.int64)
        nodes = self.node_arrays(b, spec)
        starts = positions[:-1]

        def per_unit(values: np.ndarray) -> np.ndarray:
            return np.add.reduceat(values, starts) if len(values) else values

        workspace = _at(self.workspace, b)
        return UnitArrays(
            b=b,
            positions=positions,
            forward=per_unit(nodes.forward),
            recompute=per_unit(nodes.recompute),
            backward=per_unit(nodes.backward),
            weights=per_unit(self.weights),
            grads=per_unit(self.grads),
            activations=per_unit(nodes.activations),
            cut=_at(self.cut, b)[positions],
            workspace=np.maximum.reduceat(workspace, starts) if len(starts) else workspace,
            random=np.logical_or.reduceat(self.random, starts) if len(starts) else self.random,
            reseed=self.measured.reseed if self.measured is not None else 0.0,
            action=self.measured.action if self.measured is not None else 0.0,
            input_grad=None if nodes.input_grad is None else per_unit(nodes.input_grad),
            weight_grad=None if nodes.weight_grad is None else per_unit(nodes.weight_grad),
        )


@dataclass
class UnitArrays:
    """Costs of one micro-batch size per unit (``cut`` has one more entry: before each unit)."""

    b: int
    positions: np.ndarray  # node position where each unit starts, and N at the end
    forward: np.ndarray
    recompute: np.ndarray
    backward: np.ndarray
    weights: np.ndarray
    grads: np.ndarray
    activations: np.ndarray
    cut: np.ndarray
    workspace: np.ndarray  # largest single activation in the unit (costs/memory.py)
    random: np.ndarray  # the unit has random ops
    reseed: float = 0.0  # seconds per forward/recompute of a stage with random ops
    action: float = 0.0  # seconds of fixed cost per stage action (planner/machine.py)
    input_grad: np.ndarray | None = None  # measured split backward (see NodeArrays)
    weight_grad: np.ndarray | None = None


def _gradient_bytes(nodes: list[fx.Node], trainable: set[str]) -> np.ndarray:
    """Gradient bytes (trainable parameters) of every node, where first read: what data
    parallelism all-reduces."""
    grads = np.zeros(len(nodes))
    seen: set[str] = set()
    for i, node in enumerate(nodes):
        for name, nbytes in params_read(node).items():
            if name not in seen and name in trainable:
                grads[i] += nbytes
            seen.add(name)
    return grads
