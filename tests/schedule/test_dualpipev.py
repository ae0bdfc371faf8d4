"""DualPipeV (``schedule/dualpipev.py``): its steady state pairs a forward on one chunk with a
backward on the other on every rank (what ZB-V never does), its stash is what the simulator
and the planner count, and its order drawn."""

from __future__ import annotations

import pytest

from varuna_fx.errors import ScheduleError
from varuna_fx.schedule import (
    Action,
    Kind,
    Schedule,
    build_schedule,
    peak_stash_counts,
    simulate,
    text_grid,
    validate,
)
from varuna_fx.schedule.dualpipev import dualpipev


def _next_compute(acts: list[Action], k: int) -> Action | None:
    """The action after ``acts[k]``, skipping a recompute (which belongs to the B after it)."""
    for a in acts[k + 1:]:
        if a.kind is not Kind.R:
            return a
    return None


def _cross_pairs(sched: Schedule, rank: int) -> list[tuple[Action, Action]]:
    """Each forward on ``rank`` whose next action is a backward of the rank's other stage."""
    acts = sched.lists[rank]
    pairs = []
    for k, a in enumerate(acts):
        after = _next_compute(acts, k)
        if a.kind is Kind.F and after is not None and after.kind is Kind.B \
                and after.stage != a.stage:
            pairs.append((a, after))
    return pairs


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_the_steady_state_pairs_a_forward_with_the_other_chunks_backward(ranks: int) -> None:
    """Rank r's first chunk fills with 2R-r-1 forwards and its second with R; every later
    forward (the steady state and the cool-down's) runs right before a backward of another
    micro-batch on the other chunk: DualPipeV's overlapped step. ZB-V, on the same placement,
    never pairs across chunks."""
    for m in range(1, 2 * ranks + 5):
        for rc in (False, True):
            sched = build_schedule("dualpipev", 2 * ranks, m, rc)
            zbv = build_schedule("zbv", 2 * ranks, m, rc)
            for r in range(ranks):
                first, second = r, 2 * ranks - 1 - r
                fill = {first: 2 * ranks - r - 1, second: ranks}
                paired = {f: b for f, b in _cross_pairs(sched, r)}
                steady = [a for a in sched.lists[r] if a.kind is Kind.F and a.mb >= fill[a.stage]]
                assert set(steady) <= set(paired), (m, rc, r, str(sched))
                for f, b in paired.items():
                    assert b.mb < f.mb and {f.stage, b.stage} == {first, second}
                if m >= 2 * ranks:  # DeepSeek's bound: every phase there, 2m - 3R + r + 1 pairs
                    assert len(paired) == len(steady) == 2 * m - 3 * ranks + r + 1
                assert _cross_pairs(zbv, r) == []


def test_the_order_drawn_at_two_and_three_ranks() -> None:
    """The timed grid (F = 1, B = W = 1): after the fill, a rank's row alternates a forward of
    one chunk with a backward of the other (rank 0, R = 2: 0F3 3B1, 3F2 0B0, 3F3 0B1)."""
    two = text_grid(build_schedule("dualpipev", 4, 4, False))
    assert two.splitlines()[2:] == [
        "rank  0 | 0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3 3B1 3W1 3F2 0B0 0W0 3B2 3W2 3F3 0B1 0W1 3B3 "
        "3W3 0B2 0W2 .   0B3 0W3",
        "rank  1 | .   1F0 2F0 1F1 2F1 1F2 2B0 2W0 2F2 1B0 1W0 1F3 2B1 2W1 2F3 1B1 1W1 2B2 2W2 "
        "1B2 1W2 2B3 1B3 2W3 1W3"]
    three = text_grid(build_schedule("dualpipev", 6, 6, False))
    assert three.splitlines()[2:] == [
        "rank  0 | 0F0 0F1 0F2 0F3 0F4 5F0 5B0 5W0 5F1 5B1 5W1 5F2 0F5 5B2 5W2 5F3 0B0 0W0 5B3 "
        "5W3 5F4 0B1 0W1 5B4 5W4 5F5 0B2 0W2 5B5 5W5 0B3 0W3 .   .   0B4 0W4 0B5 0W5",
        "rank  1 | .   1F0 1F1 1F2 4F0 1F3 4F1 4B0 4W0 4F2 1F4 4B1 4W1 4F3 1B0 1W0 1F5 4B2 4W2 "
        "4F4 1B1 1W1 4B3 4W3 4F5 1B2 1W2 4B4 4W4 1B3 1W3 4B5 .   1B4 4W5 1B5 1W4 1W5",
        "rank  2 | .   .   2F0 3F0 2F1 3F1 2F2 3F2 2F3 3B0 3W0 3F3 2B0 2W0 2F4 3B1 3W1 3F4 2B1 "
        "2W1 2F5 3B2 3W2 3F5 2B2 2W2 3B3 3W3 2B3 2W3 3B4 3W4 2B4 3B5 2B5 2W4 3W5 2W5"]
    assert "bubble 4.0%" in two and "bubble 5.3%" in three


def _live_peak(acts: list[Action], stages: set[int]) -> int:
    """Most micro-batches ``stages`` hold together along one rank's list (F(i) to W(i))."""
    live = peak = 0
    for a in acts:
        if a.stage in stages:
            live += a.kind is Kind.F
            live -= a.kind is Kind.W
            peak = max(peak, live)
    return peak


@pytest.mark.parametrize("ranks,m", [(1, 1), (1, 5), (2, 2), (2, 4), (3, 4), (3, 9), (4, 8)])
def test_the_stash_is_what_the_simulator_counts(ranks: int, m: int) -> None:
    """Rank r's first chunk holds min(m, 2R-r) micro-batches at its peak, its second
    min(m, r+1): the per-stage counts the simulator reports (and memory is priced from);
    together the rank never holds more than their sum."""
    sched = build_schedule("dualpipev", 2 * ranks, m, False)
    sim = simulate(sched, [1.0] * 2 * ranks, [2.0] * 2 * ranks, stash_bytes=[3.0] * 2 * ranks)
    want = [0] * (2 * ranks)
    for r in range(ranks):
        want[r], want[2 * ranks - 1 - r] = min(m, 2 * ranks - r), min(m, r + 1)
    assert sim.peak_stash_count == peak_stash_counts(sched) == want
    assert sim.peak_stash_bytes == [3.0 * c for c in want]
    for r in range(ranks):
        both = {r, 2 * ranks - 1 - r}
        assert _live_peak(sched.lists[r], both) <= sum(want[s] for s in both)
        for s in both:
            assert _live_peak(sched.lists[r], {s}) == want[s]


def test_any_size_and_what_it_refuses() -> None:
    """Below DeepSeek's m >= 2R (and torch's m >= stages) the order is made for 2R
    micro-batches and the extra ones dropped: still complete and deadlock-free."""
    for ranks in (1, 2, 5):
        for m in (1, 2 * ranks - 1, 2 * ranks, 3 * ranks):
            validate(build_schedule("dualpipev", 2 * ranks, m, True))
    with pytest.raises(ScheduleError, match="dualpipev runs exactly 2 stages per rank"):
        dualpipev(2, 3, 4, [False] * 6)
