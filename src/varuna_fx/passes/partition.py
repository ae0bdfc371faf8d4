"""partition: a pure function from per-node costs to contiguous, balanced stages.

Nodes are in a topological order; a stage is a contiguous range ``[bounds[s], bounds[s+1])``.
The cost of a stage is its compute plus the time to send what crosses its right edge; the
partition minimises the largest stage cost (the pipeline's bottleneck) exactly, by dynamic
programming over cut positions (vectorised with numpy, one pass per stage), subject to a
per-stage memory cap. Memory is the package's one memory model (``costs/memory.py``: weights
where first read plus copies of shared weights, workspace, the stage input per stashed
micro-batch, activations), at each stage's own stash count from the schedule, so the k-th stage
of the programme is priced as the k-th stage of the pipeline. Among the partitions with the
optimal bottleneck it picks the one that sends the fewest bytes in total ("prefer cuts where
few, small values cross"). And it never trades several times the bytes for a sliver of
balance: on a finite-bandwidth link, a partition within ``byte_tolerance`` (2%) of the optimal
bottleneck that sends at most half the bytes wins. The send term prices bytes only as well as the bandwidth is known (an assumed fast link makes
a cut inside a block, sending several times a block boundary's bytes, look free for a sliver of
balance: bench/RESULTS.md, "Figures the code cites"), and on a measured fast link the send term
is tiny, so the rule costs at most that sliver there.

With D > 1 replicas each stage all-reduces the gradients of the parameters it holds (its own
copies of tied weights included) once per step, after its last backward: a cost the
per-micro-batch bottleneck does not see. On a slow link every stage costs its send, so every
cut looks equal and the last stage (which sends nothing) was filled with compute up to the
bottleneck, parameters piled with it (7.6M of 10M on a GPT at 0.1 Gbit/s), and its all-reduce
became most of the step. Given ``allreduce_per_byte`` the partition minimises the step's own
shape, ``(m + P - 1) x bottleneck + the largest stage's all-reduce``, over the partitions that
cap the all-reduce (``weigh_allreduce.py``).

Nothing here knows about graphs: tests feed it synthetic arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..costs.memory import MemoryModel, SharedWeight, format_bytes_apart
from ..errors import PartitionError
from .bottleneck import fewest_bytes, smallest_bottleneck
from .stage_costs import StageCosts
from .weigh_allreduce import AllReduce, weigh_allreduce

_FEWER_BYTES = 0.5  # "several times fewer": the loose partition must send at most this share


@dataclass(frozen=True)
class PartitionProblem:
    compute: np.ndarray  # [N] time of each node (forward + backward (+ recompute))
    weight_bytes: np.ndarray  # [N] bytes for the node's parameters (weights, grads, optimizer)
    activation_bytes: np.ndarray  # [N] bytes of activations one micro-batch leaves at the node
    cut_bytes: np.ndarray  # [N+1] bytes crossing a cut before position j; inf: cut forbidden
    bandwidth: float = float("inf")  # bytes/s between neighbouring stages
    # per boundary k (between stage k and k + 1; P - 1 of them), where the links differ (fast
    # within a node, slow between nodes): stage k's send is priced at its own link's; None:
    # ``bandwidth`` for every boundary
    bandwidths: tuple[float, ...] | None = None
    memory_cap: float = float("inf")  # bytes per stage
    # micro-batches whose stash each stage holds at once: one count for every stage, or one per
    # stage (the schedule's ``peak_stash_counts``)
    stash_counts: int | tuple[int, ...] = 1
    # stash only stage inputs (else all activations) per micro-batch; "auto": per stage, only
    # where the stage does not fit otherwise (compute is then the recomputing time and
    # last_stage_compute the plain one)
    recompute: bool | str = True
    # [N] time of each node on the last stage, if different: the last stage never recomputes
    last_stage_compute: np.ndarray | None = None
    # bottleneck (relative) given up for a partition sending at most half the bytes; 0: exact
    byte_tolerance: float = 0.02
    # [N] the node's largest single activation (its gradient is the backward's workspace)
    workspace_bytes: np.ndarray | None = None
    # weights read by several nodes: a stage reading one whose first reader is on an earlier
    # stage holds its own copy (``weight_bytes`` counts it where first read)
    shared: tuple[SharedWeight, ...] = ()
    # buffers forward writes: (first, last) node reading or writing each; the nodes between
    # stay on one stage (their cuts are forbidden), named when that leaves too few cuts
    written_spans: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    # [N] gradient bytes of the trainable parameters a node reads first (shared weights' copies
    # come from ``shared``): what data parallelism all-reduces
    grad_bytes: np.ndarray | None = None
    # seconds per gradient byte of a stage's all-reduce over its replicas (ring: 2 (D-1)/D over
    # the replica link's bandwidth), and per all-reduce; 0: one replica, nothing to weigh
    allreduce_per_byte: float = 0.0
    allreduce_latency: float = 0.0
    micro_batches: int = 1  # m: the pipeline part of a step is about (m + P - 1) bottlenecks

    def __post_init__(self) -> None:
        n = len(self.compute)
        if self.last_stage_compute is not None and len(self.last_stage_compute) != n:
            raise ValueError("last_stage_compute must have one entry per node")
        if len(self.weight_bytes) != n or len(self.activation_bytes) != n:
            raise ValueError("compute, weight_bytes and activation_bytes must have equal length")
        if self.workspace_bytes is not None and len(self.workspace_bytes) != n:
            raise ValueError("workspace_bytes must have one entry per node")
        if len(self.cut_bytes) != n + 1:
            raise ValueError("cut_bytes must have one entry per cut position (N + 1)")
        if self.grad_bytes is not None and len(self.grad_bytes) != n:
            raise ValueError("grad_bytes must have one entry per node")
        if self.recompute == "auto" and self.last_stage_compute is None:
            raise ValueError("recompute='auto' needs last_stage_compute (the plain times)")

    def counts(self, num_stages: int) -> tuple[int, ...]:
        """The stash count of each of ``num_stages`` stages."""
        if isinstance(self.stash_counts, (int, np.integer)):
            return (int(self.stash_counts),) * num_stages
        if len(self.stash_counts) != num_stages:
            raise ValueError(f"stash_counts has {len(self.stash_counts)} entries for "
                             f"{num_stages} stages")
        return tuple(int(c) for c in self.stash_counts)

    def memory_model(self) -> MemoryModel:
        workspace = np.zeros(len(self.compute)) if self.workspace_bytes is None \
            else self.workspace_bytes
        return MemoryModel(self.weight_bytes, self.activation_bytes, self.cut_bytes, workspace,
                           self.shared)


@dataclass(frozen=True)
class Partition:
    bounds: tuple[int, ...]  # P + 1 positions, bounds[0] = 0, bounds[-1] = N
    stage_times: tuple[float, ...]  # seconds: compute + send time of each stage
    stage_memory: tuple[float, ...]  # peak bytes of each stage (``memory_model``)
    bottleneck: float
    recompute: tuple[bool, ...] = ()  # per stage: whether it recomputes (set by the partition)
    # per stage: seconds of its all-reduce over the replicas (``allreduce_per_byte``), or ()
    allreduce: tuple[float, ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def stage_of(self, position: int) -> int:
        return int(np.searchsorted(self.bounds, position, side="right") - 1)


def partition(costs: PartitionProblem, num_stages: int) -> Partition:
    """Optimal contiguous partition of N nodes into ``num_stages`` non-empty stages."""
    n = len(costs.compute)
    if num_stages < 1:
        raise PartitionError(f"stages={num_stages}: a pipeline needs at least 1 stage")
    if num_stages > n:
        raise PartitionError(
            f"stages={num_stages} is more than the {n} operations of the model: "
            f"use at most {n} stages"
        )
    costs.counts(num_stages)  # one stash count per stage
    positions = _candidate_cuts(costs)
    # Reduction drops only partitions with a stage that computes nothing (both cuts in one run
    # of free nodes); those can matter only when stages are nearly as many as operations.
    if len(positions) - 1 < 4 * num_stages:
        positions = [0, *(j for j in range(1, n) if np.isfinite(costs.cut_bytes[j])), n]
    reduced = _reduce(costs, positions)
    allreduce = _allreduce(reduced)
    stages = StageCosts(reduced, num_stages, allreduce)
    cut = np.asarray(reduced.cut_bytes, dtype=np.float64)
    bottleneck = smallest_bottleneck(stages, num_stages, len(positions) - 1)
    if not np.isfinite(bottleneck):
        _explain_infeasible(costs, num_stages)
    weights = stages.weights()  # a byte over a slow link counts for more
    unit_bounds = fewest_bytes(stages, cut, num_stages, bottleneck, weights)
    # an infinite bandwidth says the links are free (or the caller prices only compute)
    finite = np.isfinite(costs.bandwidth) if costs.bandwidths is None else \
        bool(np.all(np.isfinite(costs.bandwidths)))
    tolerance = costs.byte_tolerance if finite else 0.0
    if tolerance > 0 and num_stages > 1:
        loose = fewest_bytes(stages, cut, num_stages, bottleneck * (1 + tolerance),
                             weights)
        if _bytes_sent(cut, loose, weights) <= \
                _FEWER_BYTES * _bytes_sent(cut, unit_bounds, weights):
            unit_bounds = loose
    if allreduce is not None and num_stages > 1:
        unit_bounds = weigh_allreduce(stages, cut, num_stages, unit_bounds,
                                      reduced.micro_batches, tolerance, weights)
    return _made(stages, positions, unit_bounds)


def evaluate(costs: PartitionProblem, bounds: tuple[int, ...]) -> Partition:
    """The partition with the given ``bounds`` (P + 1 node positions), priced as
    ``partition`` prices its own: stage costs, memory, recompute flags, all-reduce. Raises
    PartitionError where a stage may not be (a forbidden cut) or does not fit."""
    num_stages = len(bounds) - 1
    positions = [int(b) for b in bounds]
    reduced = _reduce(costs, positions)
    stages = StageCosts(reduced, num_stages, _allreduce(reduced))
    units = list(range(num_stages + 1))
    if not all(np.isfinite(stages.at(k, k, k + 1)) for k in range(num_stages)):
        raise PartitionError(f"stage bounds {positions} cut where no cut may be, or a stage "
                             "does not fit in memory")
    return _made(stages, positions, units)


def _allreduce(reduced: PartitionProblem) -> AllReduce | None:
    return AllReduce.of(reduced.grad_bytes, reduced.shared, reduced.allreduce_per_byte,
                        reduced.allreduce_latency, len(reduced.compute))


def _made(stages: StageCosts, positions: list[int],
          unit_bounds: list[int]) -> Partition:
    pairs = list(zip(unit_bounds, unit_bounds[1:]))
    stage_times = tuple(stages.at(k, i, j) for k, (i, j) in enumerate(pairs))
    flags = tuple(stages.recomputes(i, j, k) for k, (i, j) in enumerate(pairs))
    bounds = tuple(positions[u] for u in unit_bounds)
    reduces = () if stages.reduces is None else \
        tuple(float(stages.reduces(i, j)) for i, j in pairs)
    return Partition(bounds, stage_times, stages.memory(unit_bounds), max(stage_times), flags,
                     reduces)


def _bytes_sent(cut: np.ndarray, unit_bounds: list[int],
                weights: np.ndarray | None = None) -> float:
    """Bytes crossing the cuts (each weighed by its link's ``weights``, where given)."""
    inner = unit_bounds[1:-1]
    if weights is None:
        return float(sum(cut[j] for j in inner))
    return float(sum(cut[j] * w for j, w in zip(inner, weights)))


def _candidate_cuts(costs: PartitionProblem) -> list[int]:
    free = free_nodes(costs.compute, costs.weight_bytes, costs.activation_bytes,
                      costs.workspace_bytes, costs.shared)
    return candidate_cuts(free, np.asarray(costs.cut_bytes, dtype=np.float64))


def free_nodes(compute: np.ndarray, weights: np.ndarray, activations: np.ndarray,
               workspace: np.ndarray | None, shared: tuple[SharedWeight, ...]) -> np.ndarray:
    """Nodes that change no stage's cost or memory wherever a cut next to them falls: no
    compute, weights, activations or workspace, and no shared weight read."""
    free = (compute == 0) & (weights == 0) & (activations == 0)
    if workspace is not None:
        free &= workspace == 0
    for item in shared:
        free[item.nodes] = False
    return free


def candidate_cuts(free: np.ndarray, cut_bytes: np.ndarray) -> list[int]:
    """Cut positions worth considering: allowed ones (finite ``cut_bytes``), and of a run of
    positions separated only by ``free`` nodes (no compute, weights or activations: views,
    getitem), the one sending the fewest bytes. Both stages around such a run cost the same
    wherever in the run the cut falls, so this keeps the optimum exact while shrinking the
    O(N^2) problem several-fold. Shared with the planner's cost table."""
    n = len(free)
    positions = [0]
    for j in range(1, n):
        if not np.isfinite(cut_bytes[j]):
            continue
        last = positions[-1]
        if last != 0 and free[last:j].all():
            if cut_bytes[j] < cut_bytes[last]:
                positions[-1] = j
            continue
        positions.append(j)
    positions.append(n)
    return positions


def _reduce(costs: PartitionProblem, positions: list[int]) -> PartitionProblem:
    """Costs of the units between consecutive candidate cuts."""
    def sums(values: np.ndarray) -> np.ndarray:
        prefix = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])
        return np.diff(prefix[positions])

    last = costs.last_stage_compute
    workspace = costs.workspace_bytes
    grads = costs.grad_bytes
    return dataclasses.replace(
        costs, compute=sums(costs.compute), weight_bytes=sums(costs.weight_bytes),
        activation_bytes=sums(costs.activation_bytes),
        cut_bytes=np.asarray(costs.cut_bytes, dtype=np.float64)[positions],
        last_stage_compute=None if last is None else sums(last),
        workspace_bytes=None if workspace is None else np.maximum.reduceat(
            np.asarray(workspace, dtype=np.float64), positions[:-1]),
        shared=tuple(item.in_units(positions) for item in costs.shared),
        grad_bytes=None if grads is None else sums(grads),
    )


def held_together(spans: Mapping[str, tuple[int, int]], n: int) -> str:
    """The sentence naming a buffer written in forward whose reads and writes span at least
    half of the ``n`` nodes (so they, not the model's shape, leave few cuts), or ''."""
    wide = sorted(((last - first, name) for name, (first, last) in spans.items()
                   if n > 1 and last - first >= n // 2), reverse=True)
    if not wide:
        return ""
    name = wide[0][1]
    first, last = spans[name]
    return (f". The buffer {name!r} is written in forward and read or written from operation "
            f"{first + 1} to {last + 1} of {n}: those stay on one stage, because each stage "
            "holds its own copy of the buffers it reads. Read and update such a buffer close "
            "together in forward to allow more stages")


def _explain_infeasible(costs: PartitionProblem, num_stages: int) -> None:
    if not np.isfinite(costs.memory_cap):
        raise PartitionError(
            f"cannot cut the model into {num_stages} stages: too few places where only tensors "
            "cross between operations; use fewer stages"
            f"{held_together(costs.written_spans, len(costs.compute))}"
        )
    unconstrained = dataclasses.replace(costs, memory_cap=float("inf"))
    loose = partition(unconstrained, num_stages)
    worst = int(np.argmax(loose.stage_memory))
    have, need = format_bytes_apart(costs.memory_cap, float(loose.stage_memory[worst]))
    raise PartitionError(
        f"no partition into {num_stages} stages fits in {have} per device: "
        f"the best balanced one needs {need} on stage {worst}. "
        "Use more stages, a smaller micro-batch, "
        + ("" if costs.recompute else "recomputation, ")  # only what is not on already
        + "or devices with more memory"
    )

