"""The step time of a schedule timed once, as :func:`~varuna_fx.schedule.simulate.simulate`
times it, without compiling the schedule or recording a timeline (the planner's orders)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from varuna_fx.errors import ScheduleError
from varuna_fx.schedule.actions import Kind, Schedule
from varuna_fx.schedule.links import cross, link_seconds
from varuna_fx.schedule.schedule_costs import ScheduleCosts, simulator_arguments, stage_seconds
from varuna_fx.schedule.simulate import bubble_fraction, simulate
from varuna_fx.schedule.validate import check_complete, execution_order


@dataclass(frozen=True)
class StepTiming:
    """What the planner needs of a simulated step: :func:`simulate`'s ``step_time`` and
    ``bubble_fraction``, bit for bit."""

    step_time: float
    bubble_fraction: float


def simulate_step(
    schedule: Schedule,
    forward: Sequence[float],
    backward: Sequence[float],
    recompute: Sequence[float] | None = None,
    send_bytes: Sequence[float] | None = None,
    latency: float = 0.0,
    bandwidth: float | Sequence[float] = math.inf,
    weight_grad: Sequence[float] | None = None,
) -> StepTiming:
    """:func:`simulate`'s step time and bubble for a schedule simulated once (the planner's
    orders, made per candidate), without compiling it or recording a timeline.

    Same arguments and the same arithmetic in the same order per action, so the same floats:
    every action starts at the later of its stage's previous end and its dependency's
    arrival, and a link's messages queue in their receiver's list order, so the times do not
    depend on which valid global order visits the actions. This one sweeps the stages
    round-robin, each as far as its dependencies are done (compiling the schedule first
    cost several times the simulation at P=25, m=32, and each order is timed once). The
    sweep checks what ``check_complete`` does on the way (each action once, on its stage,
    after its F / R / B); on anything wrong, ``check_complete`` says what. A virtual
    schedule (ranks running several stages) is timed by :func:`simulate`."""
    if schedule.is_virtual:
        sim = simulate(schedule, forward, backward, recompute, send_bytes, latency, bandwidth,
                       weight_grad=weight_grad)
        return StepTiming(sim.step_time, sim.bubble_fraction)
    p, m = schedule.num_stages, schedule.num_micro_batches
    per_stage = schedule.per_stage
    if p < 1 or m < 1 or len(per_stage) != p or (
            not isinstance(schedule.recompute, bool) and len(schedule.recompute) != p):
        check_complete(schedule)  # raises
    split = schedule.split_backward
    fwd, rec, bwd, wgt = stage_seconds(p, split, forward, backward, recompute, weight_grad)
    wire = link_seconds(p, send_bytes, bandwidth)
    comm = [float(latency) + w for w in wire]
    recomputes = [schedule.recomputes(s) for s in range(p)]
    # per link direction: when it is next free (forward: link s-1 into stage s; backward:
    # link s into stage s), as ``simulate``'s ``free``
    free_f, free_b = [0.0] * p, [0.0] * p
    f_end: list[list[float | None]] = [[None] * m for _ in range(p)]  # None: not run yet
    b_end: list[list[float | None]] = [[None] * m for _ in range(p)]
    r_ran, w_ran = [bytearray(m) for _ in range(p)], [bytearray(m) for _ in range(p)]
    stage_end = [0.0] * p
    heads = [0] * p
    left = sum(len(acts) for acts in per_stage)
    kind_f, kind_r, kind_b = Kind.F, Kind.R, Kind.B
    valid = True
    while left and valid:
        progressed = False
        for s in range(p):
            acts, h = per_stage[s], heads[s]
            n, t = len(acts), stage_end[s]
            up, down = f_end[s - 1] if s > 0 else None, b_end[s + 1] if s < p - 1 else None
            own_f, own_b, own_r, own_w = f_end[s], b_end[s], r_ran[s], w_ran[s]
            while h < n:
                act = acts[h]
                kind, i = act.kind, act.mb
                if act.stage != s or not 0 <= i < m:
                    valid = False
                    break
                if kind is kind_f:
                    if own_f[i] is not None:
                        valid = False
                        break
                    if up is not None:
                        ready = up[i]
                        if ready is None:
                            break
                        ready = cross(free_f, s, ready, wire[s - 1], comm[s - 1])
                        if ready > t:
                            t = ready
                    t += fwd[s]
                    own_f[i] = t
                elif kind is kind_b:
                    if own_b[i] is not None or (
                            not own_r[i] if recomputes[s] else own_f[i] is None):
                        valid = False
                        break
                    if down is not None:
                        ready = down[i]
                        if ready is None:
                            break
                        ready = cross(free_b, s, ready, wire[s], comm[s])
                        if ready > t:
                            t = ready
                    t += bwd[s]
                    own_b[i] = t
                elif kind is kind_r:
                    if not recomputes[s] or own_r[i] or own_f[i] is None:
                        valid = False
                        break
                    own_r[i] = 1
                    t += rec[s]
                else:
                    if not split or own_w[i] or own_b[i] is None:
                        valid = False
                        break
                    own_w[i] = 1
                    t += wgt[s]
                h += 1
            if h != heads[s]:
                left -= h - heads[s]
                heads[s], stage_end[s] = h, t
                progressed = True
            if not valid:
                break
        if valid and not progressed:
            check_complete(schedule)  # (actions missing can stall it)
            execution_order(schedule)  # raises, naming what each stage waits for
            raise ScheduleError("internal error: simulate_step stalled on a valid order")
    # every action ran once, after the ones it needs: now each ran (R, W where needed)
    if not valid or any(None in f_end[s] or None in b_end[s]
                        or (recomputes[s] and 0 in r_ran[s]) or (split and 0 in w_ran[s])
                        for s in range(p)):
        check_complete(schedule)  # raises, naming what is wrong
        raise ScheduleError("internal error: simulate_step rejected a complete schedule")
    step = max(stage_end)
    # a complete schedule runs every F and B once per micro-batch, R where the stage
    # recomputes and W where the backward is split: ``simulate``'s per-stage counts
    busy = [m * fwd[s] + (m if recomputes[s] else 0) * rec[s] + m * bwd[s]
            + (m if split else 0) * wgt[s] for s in range(p)]
    return StepTiming(step, bubble_fraction([step - b for b in busy], step))


def simulate_costs_step(schedule: Schedule, costs: ScheduleCosts) -> StepTiming:
    """:func:`simulate_step` with a :class:`ScheduleCosts`: ``simulate_costs``'s step time
    and bubble for an order timed once."""
    return simulate_step(schedule, **simulator_arguments(costs, schedule.num_stages))  # type: ignore[arg-type]
