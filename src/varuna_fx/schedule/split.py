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
from functools import lru_cache

from varuna_fx.errors import ScheduleError
from varuna_fx.schedule.actions import Action, Kind, Schedule
from varuna_fx.schedule.links import cross
from varuna_fx.schedule.schedule_costs import ScheduleCosts
from varuna_fx.schedule.simulate_step import simulate_costs_step
from varuna_fx.schedule.structure import peak_stash_counts
from varuna_fx.schedule.varuna import fastest

_INF = float("inf")
_F, _R, _B, _W = Kind.F, Kind.R, Kind.B, Kind.W  # (an Enum member by attribute is slow)


@lru_cache(maxsize=16)
def _weight_actions(p: int, m: int) -> list[list[Action]]:
    """The W actions of a (P, m) schedule, made once: every placement holds the same ones."""
    return [[Action(s, _W, i) for i in range(m)] for s in range(p)]


def _eager(base: list[list[Action]], m: int) -> list[list[Action]]:
    weights = _weight_actions(len(base), m)
    out: list[list[Action]] = []
    for s, acts in enumerate(base):
        stage: list[Action] = []
        for a in acts:
            stage.append(a)
            if a.kind is _B:
                stage.append(weights[s][a.mb])
        out.append(stage)
    return out


def _fill(base: list[list[Action]], costs: ScheduleCosts, recompute: Sequence[bool],
          caps: Sequence[int], fit: bool) -> tuple[list[list[Action]], float]:
    """Event simulation of the base lists with ``W`` placed in the gaps (see module doc);
    returns the lists and their step as ``simulate`` times them with ``costs``.

    Of the stages that can act, the one free earliest (then the lowest) acts next; a stage
    whose next action waits for data not yet placed is set aside until its producer is
    placed (a heap of the stages that can act, instead of sorting all at every action:
    P=56, m=64 took seconds per order). The planner's hot path with Varuna's generator, so
    one loop over plain lists: no per-action helper calls."""
    p = len(base)
    m = 1 + max((a.mb for acts in base for a in acts), default=0)
    last = p - 1
    lengths = [len(acts) for acts in base]
    head = [0] * p
    pending: list[deque[int]] = [deque() for _ in range(p)]
    live = [0] * p  # micro-batches whose F started and whose W has not
    free = [0.0] * p  # when the stage finishes what it runs
    f_end = [[_INF] * m for _ in range(p)]  # when F(s, i) / B(s, i) ends as placed
    b_end = [[_INF] * m for _ in range(p)]
    link = [costs.link(s) for s in range(p - 1)]
    f_cost = [costs.f(s) for s in range(p)]
    r_cost = [costs.r(s) for s in range(p)]
    b_cost = [costs.b(s, split=True) for s in range(p)]
    weight = [costs.w(s) for s in range(p)]
    weights = _weight_actions(p, m)
    out: list[list[Action]] = [[] for _ in range(p)]
    # the simulator's timing of the lists as they grow (the order actions are placed in
    # respects every dependency, and a link's messages cross in their receiver's order)
    sim_f = [[0.0] * m for _ in range(p)]
    sim_b = [[0.0] * m for _ in range(p)]
    sim_stage = [0.0] * p
    free_f, free_b = [0.0] * p, [0.0] * p  # per link: when it is next free, each way
    step = 0.0

    def ready_at(s: int, a: Action) -> float:
        """When ``a``'s cross-stage data is here (inf while its producer has not run)."""
        if a.kind is _F:
            return f_end[s - 1][a.mb] + link[s - 1] if s > 0 else 0.0
        if a.kind is _B:
            return b_end[s + 1][a.mb] + link[s] if s < last else 0.0
        return 0.0

    def can_act(s: int) -> bool:
        if head[s] >= lengths[s]:
            return bool(pending[s])
        a = base[s][head[s]]
        if a.kind is _F and live[s] >= caps[s] and pending[s]:
            return True
        return ready_at(s, a) != _INF

    def awaited(s: int) -> int:
        """The key of the producer ``s``'s next action waits for: 2 (stage * m + mb), + 1
        for a backward."""
        a = base[s][head[s]]
        if a.kind is _F:
            return 2 * ((s - 1) * m + a.mb)
        return 2 * ((s + 1) * m + a.mb) + 1

    waiting: dict[int, int] = {}  # producer key -> the stage waiting for it
    heap = [(0.0, s) for s in range(p) if can_act(s)]
    for s in range(p):
        if not can_act(s) and head[s] < lengths[s]:
            waiting[awaited(s)] = s
    heapq.heapify(heap)
    total = sum(lengths)
    placed = 0
    item = heapq.heappop(heap) if heap else None
    while item is not None:
        s = item[1]
        # act: a pending W when the next forward would hold too many micro-batches, or
        # when the next action's data is not here yet (and, with ``fit``, the W fits in
        # the gap); else the next action, when its data is here
        t = free[s]
        h = head[s]
        if h >= lengths[s]:
            if not pending[s]:
                raise ScheduleError("internal error: split-backward placement stalled")
            a = weights[s][pending[s].popleft()]
        else:
            a = base[s][h]
            kind = a.kind  # (``ready_at``, inlined here and below: once per action)
            if kind is _F:
                r = f_end[s - 1][a.mb] + link[s - 1] if s > 0 else 0.0
            elif kind is _B:
                r = b_end[s + 1][a.mb] + link[s] if s < last else 0.0
            else:
                r = 0.0
            if kind is _F and live[s] >= caps[s] and pending[s]:
                a = weights[s][pending[s].popleft()]
            elif r == _INF:
                raise ScheduleError("internal error: split-backward placement stalled")
            elif pending[s] and r > t and (not fit or r - t >= weight[s]):
                a = weights[s][pending[s].popleft()]  # fill the gap
            else:
                t = max(r, t)
                head[s] = h + 1
        # run it from t, and time it as the simulator does
        kind, i = a.kind, a.mb
        out[s].append(a)
        ready = 0.0
        if kind is _F:
            cost = f_cost[s]
            f_end[s][i] = t + cost
            live[s] += 1
            if s > 0:
                ready = cross(free_f, s - 1, sim_f[s - 1][i], link[s - 1], link[s - 1])
        elif kind is _B:
            cost = b_cost[s]
            b_end[s][i] = t + cost
            pending[s].append(i)
            if s < last:
                ready = cross(free_b, s, sim_b[s + 1][i], link[s], link[s])
        elif kind is _R:
            cost = r_cost[s]
        else:
            cost = weight[s]
            live[s] -= 1
        free[s] = t + cost
        begin = sim_stage[s] if sim_stage[s] >= ready else ready
        end = sim_stage[s] = begin + cost
        if end > step:
            step = end
        if kind is _F:
            sim_f[s][i] = end
            placed += 1
            waiter = waiting.pop(2 * (s * m + i), None)  # a consumer may be able to act now
            if waiter is not None:
                heapq.heappush(heap, (free[waiter], waiter))
        elif kind is _B:
            sim_b[s][i] = end
            placed += 1
            waiter = waiting.pop(2 * (s * m + i) + 1, None)
            if waiter is not None:
                heapq.heappush(heap, (free[waiter], waiter))
        elif kind is _R:
            placed += 1
        h = head[s]  # can it act again (``can_act``)?
        if h >= lengths[s]:
            again = bool(pending[s])
        else:
            a = base[s][h]
            kind = a.kind
            if kind is _F:
                again = (live[s] >= caps[s] and bool(pending[s])) or \
                    (f_end[s - 1][a.mb] + link[s - 1] if s > 0 else 0.0) != _INF
            elif kind is _B:
                again = (b_end[s + 1][a.mb] + link[s] if s < last else 0.0) != _INF
            else:
                again = True
        if again:  # (push and pop at once: it is often the next to act)
            item = heapq.heappushpop(heap, (free[s], s))
        else:
            if h < lengths[s]:
                waiting[awaited(s)] = s
            item = heapq.heappop(heap) if heap else None
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
        eager = _eager(base, m)
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
