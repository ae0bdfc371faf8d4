"""Virtual stages: schedules whose ranks run several stages each (interleaved 1F1B, ZB-V;
DualPipeV, on ZB-V's placement, is ``dualpipev.py``).

With ``v`` stages per rank a micro-batch passes each rank ``v`` times, every stage is ``1/v`` of
the work a rank would otherwise hold, and the fill and drain of the pipeline shrink with it: the
bubble of 1F1B, ``(R - 1) / m`` of the ideal step, becomes about ``(R - 1) / (v m)`` (Narayanan et
al., SC'21). The price is traffic: each boundary that crosses ranks carries a message, so
point-to-point bytes grow with the number of boundaries between ranks.

* ``interleaved-1f1b`` (looped placement, stage s on rank s mod R): micro-batches go through
  the ranks in groups of G (R, or the nearest even split of m into groups of at least R); a
  rank runs a group's forwards on its first stage, then on its second, ... (depth first), and
  its backwards in the same groups with its stages in reverse. Each rank warms up with
  ``(v - 1) G + 2 (R - 1 - r)`` forwards (enough that the last rank's first backward has its
  forward, plus two per hop back to rank r), then alternates one forward and one backward,
  then drains its backwards.
* ``zbv`` (V-shape, rank r runs stages r and 2R-1-r) with split backward, as ZB-V (Qi et al.,
  ICLR'24, section 6): the first stage of each rank fills the pipeline down, the second brings
  it back up, and the weight-gradient parts ``W`` fill what would be bubbles. The turn at the
  last rank and the first/last stage pair of rank 0 are local, so a tied embedding and head
  sit on one rank. Phases of rank r (``n = max(m, 2R - 1)`` micro-batches, those past m then
  dropped): ``2(R-r)-1`` forwards of its first stage; ``r`` pairs of forwards (second, first);
  ``R-r`` triples (F, B, W) of its second stage; then the steady step (F, B, W on the first,
  F, B, W on the second) until every forward ran; then ``r`` pairs of backwards (first,
  second), ``R-r`` pairs (B, W) on the first, and the weight gradients still pending.

Both orders depend on no costs (like 1F1B). Their entries (placement, default stages per rank,
split backward) are in the registry (``registry.py``). Recompute: a stage that recomputes runs each
micro-batch's ``R`` right before its ``B``. Dropping whole micro-batches from a deadlock-free
order leaves it deadlock-free (dependencies stay within a micro-batch), which is how m below
the pipeline's depth is handled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from varuna_fx.errors import ScheduleError
from varuna_fx.schedule.actions import Action, Kind

RankLists = list[list[Action]]
# (ranks R, stages per rank v, micro-batches m, per-stage recompute) -> one list per rank
VirtualFn = Callable[[int, int, int, Sequence[bool]], RankLists]


def with_recompute(acts: list[Action], recompute: Sequence[bool]) -> list[Action]:
    """``acts`` with an ``R`` inserted right before each ``B`` of a stage that recomputes."""
    out: list[Action] = []
    for a in acts:
        if a.kind is Kind.B and recompute[a.stage]:
            out.append(Action(a.stage, Kind.R, a.mb))
        out.append(a)
    return out


def _groups(m: int, size: int) -> list[range]:
    return [range(g, min(m, g + size)) for g in range(0, m, size)]


def interleaved_1f1b(ranks: int, per_rank: int, m: int, recompute: Sequence[bool]) -> RankLists:
    """Interleaved 1F1B on the looped placement (see the module doc)."""
    # groups of at least R micro-batches, as even as m allows: with groups of exactly R and a
    # shorter last one (m = 7, R = 5), the last group's forwards wait for backwards listed
    # after them (a deadlock the validator finds)
    size = math.ceil(m / max(1, m // ranks))
    out: RankLists = []
    for r in range(ranks):
        local = [j * ranks + r for j in range(per_rank)]  # this rank's stages, first to last
        forwards = [Action(s, Kind.F, i) for g in _groups(m, size) for s in local for i in g]
        backwards = [Action(s, Kind.B, i) for g in _groups(m, size)
                     for s in reversed(local) for i in g]
        warmup = min((per_rank - 1) * size + 2 * (ranks - 1 - r), len(forwards))
        acts = forwards[:warmup]
        for k in range(len(forwards) - warmup):
            acts += [forwards[warmup + k], backwards[k]]
        acts += backwards[len(forwards) - warmup:]
        out.append(with_recompute(acts, recompute))
    return out


def zbv(ranks: int, per_rank: int, m: int, recompute: Sequence[bool]) -> RankLists:
    """ZB-V on the V-shape placement, backward split into ``B`` and ``W`` (module doc)."""
    if per_rank != 2:
        raise ScheduleError(f"zbv runs exactly 2 stages per rank, not {per_rank}")
    n = max(m, 2 * ranks - 1)
    return [with_recompute([a for a in _zbv_rank(ranks, r, n) if a.mb < m], recompute)
            for r in range(ranks)]


def _zbv_rank(ranks: int, r: int, n: int) -> list[Action]:
    """Rank r's ZB-V order for ``n`` micro-batches (``n >= 2R - 1``), phase by phase."""
    first, second = r, 2 * ranks - 1 - r
    done = {(s, k): 0 for s in (first, second) for k in (Kind.F, Kind.B, Kind.W)}
    acts: list[Action] = []

    def run(stage: int, *kinds: Kind) -> None:
        for kind in kinds:
            acts.append(Action(stage, kind, done[(stage, kind)]))
            done[(stage, kind)] += 1

    for _ in range(2 * (ranks - r) - 1):
        run(first, Kind.F)
    for _ in range(r):
        run(second, Kind.F)
        run(first, Kind.F)
    for _ in range(ranks - r):
        run(second, Kind.F, Kind.B, Kind.W)
    while done[(second, Kind.F)] < done[(first, Kind.F)] or done[(first, Kind.F)] < n:
        if done[(first, Kind.F)] < n:
            run(first, Kind.F)
        run(first, Kind.B, Kind.W)
        run(second, Kind.F, Kind.B, Kind.W)
    for _ in range(r):
        run(first, Kind.B)
        run(second, Kind.B)
    for _ in range(ranks - r):
        run(first, Kind.B, Kind.W)
    for stage in (second, first):
        while done[(stage, Kind.W)] < done[(stage, Kind.B)]:
            run(stage, Kind.W)
    if any(count != n for count in done.values()):
        raise ScheduleError(f"internal error: zbv left work undone on rank {r}: {done}")
    return acts
