"""Discrete-event simulation of a static schedule, fast enough for a planner's inner loop.

Each stage executes its list in order; an action starts once its stage finished the previous
action and the data of its cross-stage dependency has arrived over the link (``links.cross``:
one message at a time each way, latency + bytes / bandwidth). Same-stage dependencies (R after
F, B after R) are implied by the stage's sequential order, so every action has at most one edge
that matters besides its predecessor.

Virtual stages: the lists that run in order are the ranks' (``Schedule.lists``), so an action
waits for its rank's previous action; a boundary between two stages on one rank costs nothing,
and the boundaries between one pair of ranks share that pair's wire, each way (``wire``).

:func:`simulate` replays a schedule compiled once (``structure.py``) and records its timeline;
``simulate_step.py`` times an order seen once, with the same arithmetic; both take their
per-stage seconds from ``costs.stage_seconds``.

Speed: about 10k runs/s at P=8, m=32, because the per-schedule preparation is cached on the
``Schedule`` (``structure.compiled``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from varuna_fx.schedule.actions import Action, Schedule
from varuna_fx.schedule.links import cross, link_seconds
from varuna_fx.schedule.schedule_costs import (
    ScheduleCosts,
    per_stage,
    simulator_arguments,
    stage_seconds,
)
from varuna_fx.schedule.structure import compiled


@dataclass
class SimResult:
    """Outcome of one simulated training step."""

    schedule: Schedule
    step_time: float
    busy: list[float]  # per rank (per stage when each rank runs one)
    idle: list[float]
    bubble_fraction: float  # mean over ranks of idle / step_time
    peak_stash_count: list[int]
    peak_stash_bytes: list[float] | None  # None when no stash_bytes were given
    starts: list[float] = field(repr=False)  # aligned with `actions`
    ends: list[float] = field(repr=False)
    actions: list[Action] = field(repr=False)  # a topological order

    @property
    def timeline(self) -> list[tuple[Action, float, float]]:
        """``(action, start, end)`` for every action, by start time then stage."""
        rows = list(zip(self.actions, self.starts, self.ends))
        rows.sort(key=lambda r: (r[1], r[0].stage))
        return rows


def bubble_fraction(idle: Sequence[float], step: float) -> float:
    """The idle share of all stages' time over the step."""
    return sum(idle) / (len(idle) * step) if step > 0 else 0.0


def simulate(
    schedule: Schedule,
    forward: Sequence[float],
    backward: Sequence[float],
    recompute: Sequence[float] | None = None,
    send_bytes: Sequence[float] | None = None,
    latency: float = 0.0,
    bandwidth: float | Sequence[float] = math.inf,
    stash_bytes: Sequence[float] | None = None,
    weight_grad: Sequence[float] | None = None,
) -> SimResult:
    """Simulate one step of ``schedule`` with per-stage costs (seconds per micro-batch).

    ``recompute`` defaults to ``forward`` (a recompute replays the forward). ``send_bytes[s]`` is
    what crosses link ``s`` (stage s -> s+1) per micro-batch; ``bandwidth`` is bytes/s, one value
    or one per link; ``stash_bytes[s]`` is the memory one stashed micro-batch takes on stage s.
    In a split-backward schedule ``weight_grad[s]`` is the part of ``backward[s]`` that computes
    the weight gradients (``W``; default half), and ``B`` costs the rest.
    """
    comp = compiled(schedule)
    p = schedule.num_stages
    fwd, rec, bwd, wgt = stage_seconds(p, schedule.split_backward, forward, backward, recompute,
                                       weight_grad)
    cost = fwd + rec + bwd + wgt
    wire = link_seconds(p, send_bytes, bandwidth)  # seconds a message occupies the link
    comm = [0.0] + [float(latency) + w for w in wire] * 2  # forward links, then backward
    busy_for = [0.0] + wire * 2
    free = [0.0] * comp.wires  # when each wire direction is next free

    starts: list[float] = []
    ends: list[float] = [0.0]  # slot 0: the "no dependency" sentinel
    start_append, end_append = starts.append, ends.append
    for pk, dk, lk, wk, ck in zip(comp.prev, comp.dep, comp.link, comp.wire, comp.cost_slot):
        a = ends[pk]
        b = ends[dk]
        if lk:  # messages of one direction cross in the order their receiver takes them
            b = cross(free, wk, b, busy_for[lk], comm[lk])
        t = a if a >= b else b
        start_append(t)
        end_append(t + cost[ck])

    step = max(ends)
    busy = [0.0] * schedule.num_ranks
    for s, (nf, nr, nb, nw) in enumerate(comp.counts):
        busy[schedule.rank_of(s)] += nf * fwd[s] + nr * rec[s] + nb * bwd[s] + nw * wgt[s]
    idle = [step - b for b in busy]
    bubble = bubble_fraction(idle, step)
    peak_bytes = None
    if stash_bytes is not None:
        sizes = per_stage(stash_bytes, p, "stash_bytes")
        peak_bytes = [c * b for c, b in zip(comp.peak_stash, sizes)]
    return SimResult(
        schedule=schedule,
        step_time=step,
        busy=busy,
        idle=idle,
        bubble_fraction=bubble,
        peak_stash_count=list(comp.peak_stash),
        peak_stash_bytes=peak_bytes,
        starts=starts,
        ends=ends[1:],
        actions=comp.order,
    )


def analytic_bubble(num_stages: int, num_micro_batches: int) -> float:
    """Idle fraction of GPipe / 1F1B with uniform stages and free links: (P-1)/(m+P-1)."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def simulate_costs(schedule: Schedule, costs: ScheduleCosts, **kw: object) -> SimResult:
    """:func:`simulate` with a :class:`ScheduleCosts` (link times given in seconds)."""
    return simulate(schedule, **simulator_arguments(costs, schedule.num_stages),  # type: ignore[arg-type]
                    **kw)
