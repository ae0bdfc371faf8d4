"""The structure of a schedule the simulator needs, compiled once per :class:`Schedule`.

Everything that depends only on the schedule's structure (a topological order, the index of each
action's stage predecessor and cross-stage dependency, the link it crosses, cost-table slots,
action counts and stash peaks) is compiled once per :class:`Schedule` object and cached on it,
so one ``simulate`` call is a single loop over plain Python lists. Reuse the same Schedule
object across calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from varuna_fx.schedule.actions import Action, Kind, Schedule
from varuna_fx.schedule.validate import action_id, check_complete, ordered_ids

_KIND_SLOT = {Kind.F: 0, Kind.R: 1, Kind.B: 2, Kind.W: 3}


@dataclass
class CompiledSchedule:
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

def _compile(schedule: Schedule) -> CompiledSchedule:
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
    return CompiledSchedule(
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


def compiled(schedule: Schedule) -> CompiledSchedule:
    """The cached compiled form of ``schedule``, rebuilt if its lists were changed."""
    comp = schedule.compiled_form
    key = _key(schedule)
    # List equality short-cuts on identical elements, so this check is cheap when unchanged.
    if comp is None or comp.key != key or comp.snapshot != schedule.per_stage:
        comp = _compile(schedule)
        schedule.compiled_form = comp
    return comp
