"""DualPipeV: DeepSeek's DualPipe cut in half onto the V-shape placement, as one rank order.

DualPipe (DeepSeek-V3 technical report, 2024) feeds micro-batches into a pipeline from both
ends; DualPipeV is its "cut-in-half" form on R ranks and 2R stages, placed as ZB-V places them
(``placement.py``, style "v"): rank r runs stage r (its *first* chunk, on the way down the V)
and stage 2R-1-r (its *second* chunk, on the way back up), so the turn at the last rank and the
loss next to the embedding on rank 0 are local.

What makes it DualPipeV and not ZB-V (``virtual.zbv``) is its steady state: each step pairs the
forward of one micro-batch on one chunk with the backward of another micro-batch on the *other*
chunk (DeepSeek's "overlapped forward and backward"). The two halves of a pair share no data,
so on DeepSeek's runtime one's compute hides the other's communication. ZB-V's steady step runs
F, B and W of one chunk back to back, then of the other: a forward is never followed by a
backward of the other chunk.

**What "overlap" means here.** varuna_fx runs one action at a time per rank, so a pair is two
adjacent actions of the rank's list, forward first: ``F(chunk a, i)`` then ``B(chunk b, j)``
(with its ``R`` in between where that stage recomputes). Under torchrun sends are
asynchronous and receives are posted a few actions ahead (``lowering.LOOKAHEAD``), so the
forward's activations travel while the paired backward computes, and the backward's gradient
while the next pair's forward runs; the simulator times exactly that (a message on its wire,
the rank computing meanwhile), which is how the planner prices it against ZB-V. In one
process there is nothing to hide. No fused kernel and no action kind beyond F / R / B / W is
needed: the order is the schedule.

**Split backward.** The paired backwards, and those of the warm-up and early cool-down, run
whole: ``B`` followed at once by its ``W``. The cool-down splits the rest (as DeepSeek's
``enable_zb``): their ``W`` are queued and run oldest first where the rank would wait for a
gradient, and last at the end. So the schedule is ``split_backward`` in the registry, like
ZB-V, but most of its ``W`` sit right after their ``B``.

Phases of rank r, with counters per (stage, kind) so each action takes the next micro-batch:

1. ``2(R-r-1)`` forwards of the first chunk (fill the way down);
2. ``r+1`` pairs of forwards (first, second);
3. ``R-r-1`` triples on the second chunk: ``B``, the oldest pending ``W`` (its own), ``F``;
4. the steady state, ``n-2R+r+1`` times: ``F`` first + whole ``B`` second, then ``F`` second
   + whole ``B`` first (DeepSeek leaves the last rank's first pair unoverlapped to shorten
   its bubble; one thread cannot tell the difference, so its order is the same);
5. ``R-r-1`` times: a whole ``B`` of the second chunk, then ``F`` second + whole ``B`` first;
6. ``r+1`` pairs of backwards (second, first), the later half split (from the middle pair,
   for odd r from its second-chunk ``B``, for even r from its first-chunk ``B``);
7. ``R-r-1`` times: the oldest pending ``W``, then a split ``B`` of the first chunk;
8. the ``r+1`` pending ``W``.

**Any m.** DeepSeek's and torch's versions need ``m >= 2R`` (every phase non-negative). Here
the order is made for ``n = max(m, 2R)`` micro-batches and those past ``m`` are dropped:
dependencies stay within a micro-batch, so what is left stays complete and deadlock-free
(``virtual.py`` does the same for ZB-V). Below ``2R`` the steady state is partly empty, so few
pairs remain; the planner's simulation prices that. Recompute: an ``R`` right before each ``B``
of a stage that recomputes (``virtual.with_recompute``).

Peak stash (structure only, ``structure.peak_stash``): the first chunk of rank r holds
``min(m, 2R-r)`` micro-batches at once, the second ``min(m, r+1)``, as under ZB-V: the pairs
change the order, not how much is in flight (``tests/schedule/test_dualpipev.py`` checks the
counts against the simulator's and the planner's).

The order for R = 2 ranks (4 stages, placement 0,1,1,0) and m = 4, phases apart by ``|``, the
overlapped pairs in brackets (``str(build_schedule("dualpipev", 4, 4, False))`` without them;
``text_grid`` draws it timed)::

    rank 0: 0F0 0F1 | 0F2 3F0 | 3B0 3W0 3F1 | [0F3 3B1] 3W1 [3F2 0B0] 0W0 |
            3B2 3W2 [3F3 0B1] 0W1 | 3B3 3W3 0B2 | 0W2 0B3 | 0W3
    rank 1: 1F0 2F0 1F1 2F1 | [1F2 2B0] 2W0 [2F2 1B0] 1W0 [1F3 2B1] 2W1 [2F3 1B1] 1W1 |
            2B2 2W2 1B2 1W2 2B3 1B3 | 2W3 1W3

ZB-V's rank 0 for the same sizes never follows a forward by the other chunk's backward
(``0F3 0B0``, ``3F2 3B2``: the same stage's).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from varuna_fx.errors import ScheduleError
from varuna_fx.schedule.actions import Action, Kind
from varuna_fx.schedule.virtual import RankLists, with_recompute


def dualpipev(ranks: int, per_rank: int, m: int, recompute: Sequence[bool]) -> RankLists:
    """DualPipeV on the V-shape placement, any R >= 1 and m >= 1 (module doc)."""
    if per_rank != 2:
        raise ScheduleError(f"dualpipev runs exactly 2 stages per rank (the two halves of the "
                            f"V), not {per_rank}: use stages_per_rank=2")
    n = max(m, 2 * ranks)
    return [with_recompute([a for a in _rank(ranks, r, n) if a.mb < m], recompute)
            for r in range(ranks)]


def _rank(ranks: int, r: int, n: int) -> list[Action]:
    """Rank r's order for ``n >= 2R`` micro-batches, phase by phase (module doc)."""
    first, second = r, 2 * ranks - 1 - r
    next_mb = {(s, k): 0 for s in (first, second) for k in (Kind.F, Kind.B)}
    pending: deque[Action] = deque()  # W of split backwards, oldest first
    acts: list[Action] = []

    def forward(stage: int) -> None:
        acts.append(Action(stage, Kind.F, next_mb[(stage, Kind.F)]))
        next_mb[(stage, Kind.F)] += 1

    def backward(stage: int, split: bool = False) -> None:
        """A ``B``; whole (its ``W`` right after) unless ``split`` (its ``W`` queued)."""
        i = next_mb[(stage, Kind.B)]
        next_mb[(stage, Kind.B)] += 1
        acts.append(Action(stage, Kind.B, i))
        (pending.append if split else acts.append)(Action(stage, Kind.W, i))

    def weight() -> None:
        acts.append(pending.popleft())

    def pair(f_stage: int, b_stage: int) -> None:
        """The overlapped step: a forward on one chunk, then a whole backward on the other."""
        forward(f_stage)
        backward(b_stage)

    for _ in range(2 * (ranks - r - 1)):  # 1
        forward(first)
    for _ in range(r + 1):  # 2
        forward(first)
        forward(second)
    for _ in range(ranks - r - 1):  # 3
        backward(second, split=True)
        weight()
        forward(second)
    for _ in range(n - 2 * ranks + r + 1):  # 4: the steady state
        pair(first, second)
        pair(second, first)
    for _ in range(ranks - r - 1):  # 5
        backward(second)
        pair(second, first)
    split = False
    for k in range(r + 1):  # 6
        split = split or (k == (r + 1) // 2 and r % 2 == 1)
        backward(second, split)
        split = split or (k == (r + 1) // 2 and r % 2 == 0)
        backward(first, split)
    for _ in range(ranks - r - 1):  # 7
        weight()
        backward(first, split=True)
    while pending:  # 8
        weight()
    if any(count != n for count in next_mb.values()):
        raise ScheduleError(f"internal error: dualpipev left work undone on rank {r}: {next_mb}")
    return acts
