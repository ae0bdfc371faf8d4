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

from collections import deque
from collections.abc import Sequence

from varuna_fx.errors import ScheduleError
from varuna_fx.schedule.actions import Action, Kind, Schedule
from varuna_fx.schedule.costs import ScheduleCosts
from varuna_fx.schedule.simulate import peak_stash_counts, simulate_costs
from varuna_fx.schedule.varuna import fastest

_INF = float("inf")


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
          caps: Sequence[int], fit: bool) -> list[list[Action]]:
    """Event simulation of the base lists with ``W`` placed in the gaps (see module doc)."""
    p = len(base)
    head = [0] * p
    pending: list[deque[int]] = [deque() for _ in range(p)]
    live = [0] * p  # micro-batches whose F started and whose W has not
    free = [0.0] * p  # when the stage finishes what it runs
    end: dict[Action, float] = {}
    out: list[list[Action]] = [[] for _ in range(p)]

    def ready_at(a: Action) -> float:
        """When ``a``'s cross-stage data is here (inf while its producer has not run)."""
        s, i = a.stage, a.mb
        if a.kind is Kind.F and s > 0:
            dep = end.get(Action(s - 1, Kind.F, i), _INF)
            return dep + costs.link(s - 1)
        if a.kind is Kind.B and s < p - 1:
            dep = end.get(Action(s + 1, Kind.B, i), _INF)
            return dep + costs.link(s)
        return 0.0

    def run(s: int, a: Action, t: float) -> None:
        out[s].append(a)
        end[a] = t + _cost(costs, a)
        free[s] = end[a]
        if a.kind is Kind.F:
            live[s] += 1
        elif a.kind is Kind.B:
            pending[s].append(a.mb)
        elif a.kind is Kind.W:
            live[s] -= 1

    total = sum(len(acts) for acts in base)
    done = 0
    while done < total or any(pending):
        progressed = False
        # the stage that can act earliest decides first; one whose data has an unknown arrival
        # waits until the producer has been placed (this is an offline plan: it may look ahead)
        for s in sorted(range(p), key=lambda k: free[k]):
            if head[s] >= len(base[s]):
                if not pending[s]:
                    continue
                run(s, Action(s, Kind.W, pending[s].popleft()), free[s])
            else:
                a = base[s][head[s]]
                r = ready_at(a)
                if a.kind is Kind.F and live[s] >= caps[s] and pending[s]:
                    run(s, Action(s, Kind.W, pending[s].popleft()), free[s])
                elif r == _INF:
                    continue
                elif pending[s] and r > free[s] and (not fit or r - free[s] >= costs.w(s)):
                    run(s, Action(s, Kind.W, pending[s].popleft()), free[s])  # fill the gap
                else:
                    run(s, a, max(r, free[s]))
                    head[s] += 1
                    done += 1
            progressed = True
            break  # re-sort: this stage's clock moved
        if not progressed:
            raise ScheduleError("internal error: split-backward placement stalled")
    return out


def split_backward(bases: list[list[list[Action]]], costs: ScheduleCosts,
                   recompute: Sequence[bool], name: str,
                   m: int) -> list[list[Action]]:
    """The fastest (simulated with ``costs``) placement of ``W`` into any of ``bases`` (F/R/B
    orders), the one holding fewer micro-batches on ties."""
    found = []
    for base in bases:
        p = len(base)
        plain = Schedule(name, p, m, tuple(recompute), base)
        caps = [max(peak_stash_counts(plain))] * p
        for lists in (_eager(base), _fill(base, costs, recompute, caps, fit=False),
                      _fill(base, costs, recompute, caps, fit=True)):
            sched = Schedule(name, p, m, tuple(recompute), lists, split_backward=True)
            found.append((simulate_costs(sched, costs).step_time,
                          max(peak_stash_counts(sched)), len(found), lists))
    return fastest(found)
