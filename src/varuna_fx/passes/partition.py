"""partition: a pure function from per-node costs to contiguous, balanced stages.

Nodes are in a topological order; a stage is a contiguous range ``[bounds[s], bounds[s+1])``.
The cost of a stage is its compute plus the time to send what crosses its right edge; the
partition minimises the largest stage cost (the pipeline's bottleneck) exactly, by dynamic
programming over cut positions (vectorised with numpy, one pass per stage), subject to a
per-stage memory cap. Among the partitions with the optimal bottleneck it picks the one that
sends the fewest bytes in total ("prefer cuts where few, small values cross"). And it never
trades several times the bytes for a sliver of balance: on a finite-bandwidth link, a partition
within ``byte_tolerance`` (2%) of the optimal bottleneck that sends at most half the bytes wins. The send term prices
bytes only as well as the bandwidth is known (an assumed fast link makes a cut inside an MLP,
sending 5x a block boundary's bytes, look free for 1% of balance), and on a measured fast link
the send term is tiny, so the rule costs at most that sliver there.

Nothing here knows about graphs: tests feed it synthetic arrays.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..errors import PartitionError

_REL_TOL = 1e-9
_FEWER_BYTES = 0.5  # "several times fewer": the loose partition must send at most this share


@dataclass(frozen=True)
class PartitionCosts:
    compute: np.ndarray  # [N] time of each node (forward + backward (+ recompute))
    weight_bytes: np.ndarray  # [N] bytes for the node's parameters (weights, grads, optimizer)
    activation_bytes: np.ndarray  # [N] bytes of activations one micro-batch leaves at the node
    cut_bytes: np.ndarray  # [N+1] bytes crossing a cut before position j; inf: cut forbidden
    bandwidth: float = float("inf")  # bytes/s between neighbouring stages
    memory_cap: float = float("inf")  # bytes per stage
    in_flight: int = 1  # micro-batches whose stash a stage holds at once
    # stash only stage inputs (else all activations) per micro-batch; "auto": per stage, only
    # where the stage does not fit otherwise (compute is then the recomputing time and
    # last_stage_compute the plain one)
    recompute: bool | str = True
    # [N] time of each node on the last stage, if different: the last stage never recomputes
    last_stage_compute: np.ndarray | None = None
    # bottleneck (relative) given up for a partition sending at most half the bytes; 0: exact
    byte_tolerance: float = 0.02

    def __post_init__(self) -> None:
        n = len(self.compute)
        if self.last_stage_compute is not None and len(self.last_stage_compute) != n:
            raise ValueError("last_stage_compute must have one entry per node")
        if len(self.weight_bytes) != n or len(self.activation_bytes) != n:
            raise ValueError("compute, weight_bytes and activation_bytes must have equal length")
        if len(self.cut_bytes) != n + 1:
            raise ValueError("cut_bytes must have one entry per cut position (N + 1)")
        if self.recompute == "auto" and self.last_stage_compute is None:
            raise ValueError("recompute='auto' needs last_stage_compute (the plain times)")


@dataclass(frozen=True)
class Partition:
    bounds: tuple[int, ...]  # P + 1 positions, bounds[0] = 0, bounds[-1] = N
    stage_costs: tuple[float, ...]  # compute + send time of each stage
    stage_memory: tuple[float, ...]  # estimated bytes of each stage
    bottleneck: float
    recompute: tuple[bool, ...] = ()  # per stage: whether it recomputes (set by the partition)

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def stage_of(self, position: int) -> int:
        return int(np.searchsorted(self.bounds, position, side="right") - 1)


def _matrices(costs: PartitionCosts
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """cost[i, j] and memory[i, j] of a stage [i, j); inf where i >= j or the cut is forbidden;
    and whether that stage recomputes."""
    n = len(costs.compute)
    compute = np.concatenate([[0.0], np.cumsum(costs.compute, dtype=np.float64)])
    weights = np.concatenate([[0.0], np.cumsum(costs.weight_bytes, dtype=np.float64)])
    acts = np.concatenate([[0.0], np.cumsum(costs.activation_bytes, dtype=np.float64)])
    cut = np.asarray(costs.cut_bytes, dtype=np.float64)
    send = cut / costs.bandwidth if np.isfinite(costs.bandwidth) else np.where(
        np.isfinite(cut), 0.0, np.inf)
    send = send.copy()
    send[n] = 0.0  # the last stage sends nothing on
    idx = np.arange(n + 1)
    valid = idx[:, None] < idx[None, :]
    cost = np.where(valid, compute[None, :] - compute[:, None] + send[None, :], np.inf)
    last = None
    if costs.last_stage_compute is not None:  # the stage ending at N is the last one
        last = np.concatenate([[0.0], np.cumsum(costs.last_stage_compute, dtype=np.float64)])
        cost[:, n] = np.where(idx < n, last[n] - last, np.inf)
    stage_acts = acts[None, :] - acts[:, None]
    # recomputing: the stage input per micro-batch, plus one replay in flight
    replay = costs.in_flight * np.where(np.isfinite(cut), cut, 0.0)[:, None] + stage_acts
    kept = costs.in_flight * stage_acts
    held = weights[None, :] - weights[:, None]
    recomputes = np.full(cost.shape, costs.recompute is True)
    if costs.recompute == "auto":
        # each stage recomputes only if it does not fit otherwise, and is priced by its choice
        assert last is not None
        plain = np.where(valid, last[None, :] - last[:, None] + send[None, :], np.inf)
        recomputes = held + kept > costs.memory_cap
        cost = np.where(recomputes, cost, plain)
        cost[:, n] = np.where(idx < n, last[n] - last, np.inf)
    recomputes[:, n] = False  # the last stage never recomputes
    # ...but runs each backward right after its forward: it holds about one micro-batch's
    # activations, which the replay formula prices (as it always did with recompute on)
    priced_as_replay = recomputes | (costs.recompute is True)
    if costs.recompute == "auto":
        priced_as_replay[:, n] = True
    stash = np.where(priced_as_replay, replay, kept)
    memory = np.where(valid, held + stash, np.inf)
    forbidden = ~np.isfinite(cut)
    forbidden[0] = forbidden[n] = False
    cost[forbidden, :] = np.inf  # a stage may not start at a forbidden cut...
    cost[:, forbidden] = np.inf  # ...nor end at one
    return cost, memory, cut, recomputes


def partition(costs: PartitionCosts, num_stages: int) -> Partition:
    """Optimal contiguous partition of N nodes into ``num_stages`` non-empty stages."""
    n = len(costs.compute)
    if num_stages < 1:
        raise PartitionError(f"stages={num_stages}: a pipeline needs at least 1 stage")
    if num_stages > n:
        raise PartitionError(
            f"stages={num_stages} is more than the {n} operations of the model: "
            f"use at most {n} stages"
        )
    positions = _candidate_cuts(costs)
    # Reduction drops only partitions with a stage that computes nothing (both cuts in one run
    # of free nodes); those can matter only when stages are nearly as many as operations.
    if len(positions) - 1 < 4 * num_stages:
        positions = [0, *(j for j in range(1, n) if np.isfinite(costs.cut_bytes[j])), n]
    reduced = _reduce(costs, positions)
    cost, memory, cut, recomputes = _matrices(reduced)
    cost = np.where(memory <= costs.memory_cap, cost, np.inf)
    units = len(positions) - 1
    # best[k][j]: smallest bottleneck of splitting units [0, j) into k + 1 stages.
    best = np.full((num_stages, units + 1), np.inf)
    best[0] = cost[0]
    for k in range(1, num_stages):
        best[k] = np.min(np.maximum(best[k - 1][:, None], cost), axis=0)
    bottleneck = float(best[num_stages - 1][units]) if num_stages <= units else np.inf
    if not np.isfinite(bottleneck):
        _explain_infeasible(costs, num_stages, cost, memory)
    unit_bounds = _fewest_bytes(cost, cut, num_stages, bottleneck)
    # an infinite bandwidth says the links are free (or the caller prices only compute)
    if costs.byte_tolerance > 0 and num_stages > 1 and np.isfinite(costs.bandwidth):
        loose = _fewest_bytes(cost, cut, num_stages, bottleneck * (1 + costs.byte_tolerance))
        if _bytes_sent(cut, loose) <= _FEWER_BYTES * _bytes_sent(cut, unit_bounds):
            unit_bounds = loose
    stage_costs = tuple(float(cost[i, j]) for i, j in zip(unit_bounds, unit_bounds[1:]))
    stage_memory = tuple(float(memory[i, j]) for i, j in zip(unit_bounds, unit_bounds[1:]))
    flags = tuple(bool(recomputes[i, j]) for i, j in zip(unit_bounds, unit_bounds[1:]))
    bounds = tuple(positions[u] for u in unit_bounds)
    return Partition(bounds, stage_costs, stage_memory, max(stage_costs), flags)


def _bytes_sent(cut: np.ndarray, unit_bounds: list[int]) -> float:
    return float(sum(cut[j] for j in unit_bounds[1:-1]))


def _candidate_cuts(costs: PartitionCosts) -> list[int]:
    free = (costs.compute == 0) & (costs.weight_bytes == 0) & (costs.activation_bytes == 0)
    return candidate_cuts(free, np.asarray(costs.cut_bytes, dtype=np.float64))


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


def _reduce(costs: PartitionCosts, positions: list[int]) -> PartitionCosts:
    """Costs of the units between consecutive candidate cuts."""
    def sums(values: np.ndarray) -> np.ndarray:
        prefix = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])
        return np.diff(prefix[positions])

    last = costs.last_stage_compute
    return PartitionCosts(
        sums(costs.compute), sums(costs.weight_bytes), sums(costs.activation_bytes),
        np.asarray(costs.cut_bytes, dtype=np.float64)[positions], costs.bandwidth,
        costs.memory_cap, costs.in_flight, costs.recompute,
        None if last is None else sums(last), costs.byte_tolerance,
    )


def _fewest_bytes(cost: np.ndarray, cut: np.ndarray, num_stages: int,
                  bottleneck: float) -> list[int]:
    """Among partitions whose every stage costs <= bottleneck, the one sending fewest bytes."""
    n = cost.shape[0] - 1
    limit = bottleneck * (1 + _REL_TOL) + 1e-300
    allowed = cost <= limit
    crossing = np.where(np.isfinite(cut), cut, np.inf)
    total = np.full((num_stages, n + 1), np.inf)
    parent = np.zeros((num_stages, n + 1), dtype=np.int64)
    total[0] = np.where(allowed[0], 0.0, np.inf)
    for k in range(1, num_stages):
        # entering stage k at cut i costs the bytes crossing cut i
        candidates = np.where(allowed, (total[k - 1] + crossing)[:, None], np.inf)
        parent[k] = np.argmin(candidates, axis=0)
        total[k] = candidates[parent[k], np.arange(n + 1)]
    bounds = [n]
    for k in range(num_stages - 1, 0, -1):
        bounds.append(int(parent[k][bounds[-1]]))
    bounds.append(0)
    return bounds[::-1]


def _explain_infeasible(costs: PartitionCosts, num_stages: int, cost: np.ndarray,
                        memory: np.ndarray) -> None:
    if not np.isfinite(costs.memory_cap):
        raise PartitionError(
            f"cannot cut the model into {num_stages} stages: too few places where only tensors "
            "cross between operations; use fewer stages"
        )
    unconstrained = dataclasses.replace(costs, memory_cap=float("inf"))
    loose = partition(unconstrained, num_stages)
    worst = int(np.argmax(loose.stage_memory))
    raise PartitionError(
        f"no partition into {num_stages} stages fits in {_gib(costs.memory_cap)} per device: "
        f"the best balanced one needs {_gib(loose.stage_memory[worst])} on stage {worst}. "
        "Use more stages, a smaller micro-batch, recomputation, or devices with more memory"
    )


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
