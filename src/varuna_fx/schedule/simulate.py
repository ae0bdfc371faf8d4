"""Discrete-event simulation of a static schedule, fast enough for a planner's inner loop.

Each stage executes its list in order; an action starts once its stage finished the previous
action and the data of its cross-stage dependency has arrived (dependency end + latency +
bytes / bandwidth). Each direction of a link carries one message at a time: a message sent
while the previous one is still on the wire waits for it (on a slow link, back-to-back
forwards queue; a message crossing while the other direction is busy does not). Same-stage dependencies (R after F, B after R) are implied by the stage's
sequential order, so every action has at most one edge that matters besides its predecessor.

Virtual stages: the lists that run in order are the ranks' (``Schedule.lists``), so an action
waits for its rank's previous action; a boundary between two stages on one rank costs nothing,
and the boundaries between one pair of ranks share that pair's wire, each way (``wire``).

Speed: everything that depends only on the schedule's structure (a topological order, the index
of each action's stage predecessor and cross-stage dependency, cost-table slots, stash peaks) is
compiled once per :class:`Schedule` object and cached on it, so one :func:`simulate` call is a
single loop over plain Python lists. Reuse the same Schedule object across calls.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from varuna_fx.errors import ScheduleError
from varuna_fx.schedule.actions import Action, Kind, Schedule
from varuna_fx.schedule.costs import ScheduleCosts
from varuna_fx.schedule.validate import action_id, check_complete, execution_order, ordered_ids

_KIND_SLOT = {Kind.F: 0, Kind.R: 1, Kind.B: 2, Kind.W: 3}


@dataclass
class _Compiled:
    """Structure-only data of one schedule; indices are shifted by one (0 is a 'done at t=0'
    sentinel) so the hot loop needs no branches."""

    key: tuple[object, ...]  # (P, m, recompute, split) the data was compiled for
    snapshot: list[list[Action]]
    order: list[Action]  # topological order
    prev: list[int]  # 1 + index of the stage predecessor, or 0
    dep: list[int]  # 1 + index of the cross-stage dependency, or 0
    link: list[int]  # 1 + link index crossed by that dependency (+ P - 1 going back), or 0
    wire: list[int]  # the rank-to-rank direction that message occupies (its link when v = 1)
    cost_slot: list[int]  # kind_slot * P + stage, into the flat cost table
    counts: list[tuple[int, int, int, int]]  # (#F, #R, #B, #W) per stage
    peak_stash: list[int]
    wires: int  # how many wire slots ``free`` needs


def peak_stash(acts: list[Action], split: bool = False) -> int:
    """Most micro-batches held at once: from the start of F(i) to the end of B(i) (of W(i) when
    the backward is split: the weight gradients need the stage's activations too).

    A stage runs its actions one at a time, so the count only changes in list order and the
    peak does not depend on the timings at all.
    """
    forward, release = Kind.F, Kind.W if split else Kind.B  # (a member by attribute is slow)
    live = peak = 0
    for act in acts:
        kind = act.kind
        if kind is forward:
            live += 1
            if live > peak:
                peak = live
        elif kind is release:
            live -= 1
    return peak


def peak_stash_counts(schedule: Schedule) -> list[int]:
    """Most micro-batches each stage holds at once (structure only, no timings needed)."""
    return [peak_stash(acts, schedule.split_backward) for acts in schedule.per_stage]


def _compile(schedule: Schedule) -> _Compiled:
    check_complete(schedule)
    order, ids = ordered_ids(schedule)
    p, m = schedule.num_stages, schedule.num_micro_batches
    index = [0] * (4 * m * p)  # action_id -> 1 + position in ``order``
    for k, a in enumerate(ids):
        index[a] = k + 1
    prev_of = [0] * (4 * m * p)
    for acts in schedule.lists:  # what runs in order: a rank's list
        for before, act in zip(acts, acts[1:]):
            prev_of[action_id(act.stage, act.kind, act.mb, m)] = \
                index[action_id(before.stage, before.kind, before.mb, m)]
    prev, dep, link, wire, slot = [], [], [], [], []
    across = 4 * m  # id offset of the same kind of action one stage away
    rank_of, virtual, ranks = schedule.rank_of, schedule.is_virtual, schedule.num_ranks

    def on_wire(lk: int, src: int, dst: int) -> None:
        """The dependency crosses link slot ``lk`` from stage src to stage dst."""
        a, b = rank_of(src), rank_of(dst)
        if a == b:  # two stages of one rank: no message
            link.append(0)
            wire.append(0)
        else:
            link.append(lk)
            wire.append(1 + a * ranks + b if virtual else lk)

    for act, a in zip(order, ids):
        s = act.stage
        prev.append(prev_of[a])
        kind = _KIND_SLOT[act.kind]
        slot.append(kind * p + s)
        if kind == 0 and s > 0:
            dep.append(index[a - across])
            on_wire(s, s - 1, s)  # link s-1, shifted by one
        elif kind == 2 and s < p - 1:
            dep.append(index[a + across])
            on_wire(s + p, s + 1, s)  # link s, shifted by one, in the backward direction
        else:
            dep.append(0)
            link.append(0)
            wire.append(0)
    return _Compiled(
        key=_key(schedule),
        snapshot=[list(acts) for acts in schedule.per_stage],
        order=order,
        prev=prev,
        dep=dep,
        link=link,
        wire=wire,
        cost_slot=slot,
        counts=[
            tuple(sum(a.kind is k for a in acts) for k in (Kind.F, Kind.R, Kind.B, Kind.W))
            for acts in schedule.per_stage
        ],
        peak_stash=peak_stash_counts(schedule),
        wires=1 + max(ranks * ranks, 2 * p),
    )


def _key(schedule: Schedule) -> tuple[object, ...]:
    return (schedule.num_stages, schedule.num_micro_batches, schedule.recompute,
            schedule.split_backward)


def compiled(schedule: Schedule) -> _Compiled:
    """The cached compiled form of ``schedule``, rebuilt if its lists were changed."""
    comp = schedule._compiled
    key = _key(schedule)
    # List equality short-cuts on identical elements, so this check is cheap when unchanged.
    if comp is None or comp.key != key or comp.snapshot != schedule.per_stage:
        comp = _compile(schedule)
        schedule._compiled = comp
    return comp


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


def _per_stage(values: Sequence[float], n: int, what: str) -> list[float]:
    if len(values) != n:
        raise ScheduleError(f"{what} needs {n} values (one per stage/link), got {len(values)}")
    return [float(v) for v in values]


def _link_costs(
    p: int,
    send_bytes: Sequence[float] | None,
    latency: float,
    bandwidth: float | Sequence[float],
) -> list[float]:
    """Transfer time per link (same both ways: gradients are as big as activations)."""
    sizes = (
        _per_stage(send_bytes, p - 1, "send_bytes") if send_bytes is not None else [0.0] * (p - 1)
    )
    if isinstance(bandwidth, (int, float)):
        bws = [float(bandwidth)] * (p - 1)
    else:
        bws = _per_stage(bandwidth, p - 1, "bandwidth")
    if any(bw <= 0 for bw in bws):
        raise ScheduleError(f"bandwidth must be > 0 bytes/s, got {bws}")
    return [latency + (size / bw if size else 0.0) for size, bw in zip(sizes, bws)]


def _action_costs(schedule: Schedule, forward: Sequence[float], backward: Sequence[float],
                  recompute: Sequence[float] | None, weight_grad: Sequence[float] | None
                  ) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per-stage F, R, B and W seconds; with a split backward, B is the backward less its
    weight part (default half), else W is 0."""
    p = schedule.num_stages
    fwd = _per_stage(forward, p, "forward")
    rec = fwd if recompute is None else _per_stage(recompute, p, "recompute")
    bwd = _per_stage(backward, p, "backward")
    wgt = [0.0] * p
    if schedule.split_backward:
        wgt = [b / 2 for b in bwd] if weight_grad is None else \
            _per_stage(weight_grad, p, "weight_grad")
        bwd = [b - w for b, w in zip(bwd, wgt)]
    return fwd, rec, bwd, wgt


def _bubble(idle: Sequence[float], step: float) -> float:
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
    fwd, rec, bwd, wgt = _action_costs(schedule, forward, backward, recompute, weight_grad)
    cost = fwd + rec + bwd + wgt
    wire = _link_costs(p, send_bytes, 0.0, bandwidth)  # seconds a message occupies the link
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
            f = free[wk]
            if f > b:
                b = f
            free[wk] = b + busy_for[lk]
            b += comm[lk]
        t = a if a >= b else b
        start_append(t)
        end_append(t + cost[ck])

    step = max(ends)
    busy = [0.0] * schedule.num_ranks
    for s, (nf, nr, nb, nw) in enumerate(comp.counts):
        busy[schedule.rank_of(s)] += nf * fwd[s] + nr * rec[s] + nb * bwd[s] + nw * wgt[s]
    idle = [step - b for b in busy]
    bubble = _bubble(idle, step)
    peak_bytes = None
    if stash_bytes is not None:
        sizes = _per_stage(stash_bytes, p, "stash_bytes")
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
    fwd, rec, bwd, wgt = _action_costs(schedule, forward, backward, recompute, weight_grad)
    split = schedule.split_backward
    wire = _link_costs(p, send_bytes, 0.0, bandwidth)
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
                        f = free_f[s]
                        if f > ready:
                            ready = f
                        free_f[s] = ready + wire[s - 1]
                        ready += comm[s - 1]
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
                        f = free_b[s]
                        if f > ready:
                            ready = f
                        free_b[s] = ready + wire[s]
                        ready += comm[s]
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
    return StepTiming(step, _bubble([step - b for b in busy], step))


def analytic_bubble(num_stages: int, num_micro_batches: int) -> float:
    """Idle fraction of GPipe / 1F1B with uniform stages and free links: (P-1)/(m+P-1)."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def _cost_args(schedule: Schedule, costs: ScheduleCosts) -> dict[str, object]:
    """:func:`simulate`'s arguments for a :class:`ScheduleCosts` (link times in seconds)."""
    p = schedule.num_stages
    costs.check(p)
    links = [costs.link(s) for s in range(p - 1)]
    return dict(forward=costs.forward, backward=costs.backward,
                recompute=[costs.r(s) for s in range(p)],
                send_bytes=links if any(links) else None, bandwidth=1.0,
                weight_grad=[costs.w(s) for s in range(p)])


def simulate_costs(schedule: Schedule, costs: ScheduleCosts, **kw: object) -> SimResult:
    """:func:`simulate` with a :class:`ScheduleCosts` (link times given in seconds)."""
    return simulate(schedule, **_cost_args(schedule, costs), **kw)  # type: ignore[arg-type]


def simulate_costs_step(schedule: Schedule, costs: ScheduleCosts) -> StepTiming:
    """:func:`simulate_step` with a :class:`ScheduleCosts`: ``simulate_costs``'s step time
    and bubble for an order timed once."""
    return simulate_step(schedule, **_cost_args(schedule, costs))  # type: ignore[arg-type]
