"""Split backward (zero-bubble pipelines, Qi et al., ICLR'24): place ``W`` where stages idle.

A split-backward schedule keeps its base schedule's order of F, R and B, where ``B`` now computes
only the input gradients (the part upstream waits for), and inserts each micro-batch's ``W``
(weight gradients, which nobody waits for) after its ``B``. Where is decided by an event
simulation with the real costs: a stage whose next action's data has not arrived yet runs a
pending ``W`` instead of sitting idle. A ``W`` also holds the micro-batch's activations, so a
stage never starts a forward that would hold more micro-batches than the base schedule's
busiest stage does at its peak: it runs a pending ``W`` first. So the split schedule's peak
stash is its base's (as ZB-H1 does for 1F1B: later stages may hold more than in 1F1B, up to
what stage 0 holds anyway). What is left runs at the end of the step.

Three placements, into the base order generated with the whole backward's cost and into the
one generated with only the input-gradient part's, are timed by the simulator and the fastest
wins (the one holding fewer micro-batches on ties): ``W`` right after its ``B`` (the base
schedule's own timing, so the split is never slower than its base in the simulator), filling
every gap, and filling only the gaps a ``W`` fits in.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence

from varuna_fx.errors import ScheduleError
from varuna_fx.schedule.actions import Action, Kind, Schedule
from varuna_fx.schedule.costs import ScheduleCosts
from varuna_fx.schedule.simulate import peak_stash_counts, simulate_costs_step
from varuna_fx.schedule.varuna import fastest

_INF = float("inf")
_F, _R, _B, _W = Kind.F, Kind.R, Kind.B, Kind.W  # (an Enum member by attribute is slow)


def _eager(base: list[list[Action]]) -> list[list[Action]]:
    out: list[list[Action]] = []
    for acts in base:
        stage: list[Action] = []
        for a in acts:
            stage.append(a)
            if a.kind is Kind.B:
                stage.append(Action(a.stage, Kind.W, a.mb))
        out.append(stage)
    return out


def _cost(costs: ScheduleCosts, a: Action) -> float:
    if a.kind is Kind.F:
        return costs.f(a.stage)
    if a.kind is Kind.R:
        return costs.r(a.stage)
    if a.kind is Kind.B:
        return costs.b(a.stage, split=True)
    return costs.w(a.stage)


def _fill(base: list[list[Action]], costs: ScheduleCosts, recompute: Sequence[bool],
          caps: Sequence[int], fit: bool) -> tuple[list[list[Action]], float]:
    """Event simulation of the base lists with ``W`` placed in the gaps (see module doc);
    returns the lists and their step as ``simulate`` times them with ``costs``.

    Of the stages that can act, the one free earliest (then the lowest) acts next; a stage
    whose next action waits for data not yet placed is set aside until its producer is
    placed (a heap of the stages that can act, instead of sorting all at every action:
    P=56, m=64 took seconds per order)."""
    p = len(base)
    m = 1 + max((a.mb for acts in base for a in acts), default=0)
    head = [0] * p
    pending: list[deque[int]] = [deque() for _ in range(p)]
    live = [0] * p  # micro-batches whose F started and whose W has not
    free = [0.0] * p  # when the stage finishes what it runs
    ends = {_F: [[_INF] * m for _ in range(p)], _B: [[_INF] * m for _ in range(p)]}
    link = [costs.link(s) for s in range(p - 1)]
    cost = {_F: [costs.f(s) for s in range(p)], _R: [costs.r(s) for s in range(p)],
            _B: [costs.b(s, split=True) for s in range(p)],
            _W: [costs.w(s) for s in range(p)]}
    weight = cost[_W]
    out: list[list[Action]] = [[] for _ in range(p)]
    # the simulator's timing of the lists as they grow (the order actions are placed in
    # respects every dependency, and a link's messages cross in their receiver's order)
    sim_ends = {kind: [[0.0] * m for _ in range(p)] for kind in (_F, _B)}
    sim_stage = [0.0] * p
    sim_free = [[0.0] * p, [0.0] * p]
    step = 0.0

    def producer(a: Action) -> tuple[Kind, int] | None:
        if a.kind is _F and a.stage > 0:
            return _F, a.stage - 1
        if a.kind is _B and a.stage < p - 1:
            return _B, a.stage + 1
        return None

    def ready_at(a: Action) -> float:
        """When ``a``'s cross-stage data is here (inf while its producer has not run)."""
        src = producer(a)
        if src is None:
            return 0.0
        kind, at = src
        return ends[kind][at][a.mb] + link[min(at, a.stage)]

    def run(s: int, a: Action, t: float) -> None:
        nonlocal step
        out[s].append(a)
        end = t + cost[a.kind][s]
        if a.kind is _F or a.kind is _B:
            ends[a.kind][s][a.mb] = end
        free[s] = end
        if a.kind is _F:
            live[s] += 1
        elif a.kind is _B:
            pending[s].append(a.mb)
        elif a.kind is _W:
            live[s] -= 1
        ready = 0.0
        src = producer(a)
        if src is not None:
            kind, at = src
            way, k = (0, at) if kind is _F else (1, s)
            ready = sim_ends[kind][at][a.mb]
            if sim_free[way][k] > ready:
                ready = sim_free[way][k]
            sim_free[way][k] = ready + link[k]
            ready += link[k]
        begin = sim_stage[s] if sim_stage[s] >= ready else ready
        sim_stage[s] = begin + cost[a.kind][s]
        if a.kind is _F or a.kind is _B:
            sim_ends[a.kind][s][a.mb] = sim_stage[s]
        if sim_stage[s] > step:
            step = sim_stage[s]

    def act(s: int) -> bool:
        """Let stage ``s`` act (True), or say it cannot yet (False)."""
        if head[s] >= len(base[s]):
            if not pending[s]:
                return False
            run(s, Action(s, _W, pending[s].popleft()), free[s])
            return True
        a = base[s][head[s]]
        r = ready_at(a)
        if a.kind is _F and live[s] >= caps[s] and pending[s]:
            run(s, Action(s, _W, pending[s].popleft()), free[s])
        elif r == _INF:
            return False
        elif pending[s] and r > free[s] and (not fit or r - free[s] >= weight[s]):
            run(s, Action(s, _W, pending[s].popleft()), free[s])  # fill the gap
        else:
            run(s, a, max(r, free[s]))
            head[s] += 1
        return True

    def can_act(s: int) -> bool:
        if head[s] >= len(base[s]):
            return bool(pending[s])
        a = base[s][head[s]]
        if a.kind is _F and live[s] >= caps[s] and pending[s]:
            return True
        return ready_at(a) != _INF

    # stages waiting for a producer, by (kind, producer stage, micro-batch)
    waiting: dict[tuple[Kind, int, int], int] = {}
    heap = [(0.0, s) for s in range(p) if can_act(s)]
    for s in range(p):
        if not can_act(s) and head[s] < len(base[s]):
            src = producer(base[s][head[s]])
            assert src is not None
            waiting[(*src, base[s][head[s]].mb)] = s
    heapq.heapify(heap)
    total = sum(len(acts) for acts in base)
    placed = 0
    while heap:
        _, s = heapq.heappop(heap)
        before = len(out[s])
        if not act(s):  # (only stages that can act are in the heap)
            raise ScheduleError("internal error: split-backward placement stalled")
        a = out[s][before]
        if a.kind is not _W:
            placed += 1
        if a.kind is _F or a.kind is _B:  # a consumer may be able to act now
            waiter = waiting.pop((a.kind, s, a.mb), None)
            if waiter is not None:
                heapq.heappush(heap, (free[waiter], waiter))
        if can_act(s):
            heapq.heappush(heap, (free[s], s))
        elif head[s] < len(base[s]):
            src = producer(base[s][head[s]])
            assert src is not None
            waiting[(*src, base[s][head[s]].mb)] = s
    if placed < total or any(pending):
        raise ScheduleError("internal error: split-backward placement stalled")
    return out, step


def split_backward(bases: list[list[list[Action]]], costs: ScheduleCosts,
                   recompute: Sequence[bool], name: str,
                   m: int, fit: bool = True) -> list[list[Action]]:
    """The fastest (simulated with ``costs``) placement of ``W`` into any of ``bases`` (F/R/B
    orders), the one holding fewer micro-batches on ties. ``fit``: also try filling only the
    gaps a ``W`` fits in (False: a cheaper estimate, as the planner's listed rows use)."""
    found: list[tuple[float, int, list[list[Action]]]] = []
    for base in bases:
        p = len(base)
        plain = Schedule(name, p, m, tuple(recompute), base)
        caps = [max(peak_stash_counts(plain))] * p
        eager = _eager(base)
        # (each placement is timed once: no compiled simulation)
        timed = [(simulate_costs_step(Schedule(name, p, m, tuple(recompute), eager,
                                               split_backward=True), costs).step_time, eager)]
        for gaps in (False, True)[:2 if fit else 1]:
            lists, step = _fill(base, costs, recompute, caps, gaps)
            timed.append((step, lists))
        for step, lists in timed:
            found.append((step, len(found), lists))

    def stash(index: int) -> int:
        lists = found[index][2]
        return max(peak_stash_counts(Schedule(name, len(lists), m, tuple(recompute), lists,
                                              split_backward=True)))

    return fastest(found, stash)
