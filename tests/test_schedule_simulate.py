"""Schedule simulator and renderers: analytic bubbles, stash peaks, links, caching, drawings."""

from __future__ import annotations

from pathlib import Path

import pytest

from varuna_fx.errors import ScheduleError
from varuna_fx.schedule import (
    Action,
    Kind,
    SimResult,
    analytic_bubble,
    build_schedule,
    gantt,
    simulate,
    text_grid,
)

SIZES = [(1, 1), (1, 4), (2, 1), (2, 5), (3, 3), (4, 2), (4, 8), (5, 9), (8, 32)]


def _unit(name: str, p: int, m: int, recompute: bool = True, **kw: object) -> SimResult:
    sched = build_schedule(name, p, m, recompute)
    return simulate(sched, forward=[1.0] * p, backward=[2.0] * p, recompute=[1.0] * p, **kw)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", SIZES)
def test_uniform_bubble_matches_analytic(name: str, p: int, m: int) -> None:
    res = _unit(name, p, m, recompute=False)
    assert res.step_time == pytest.approx((m + p - 1) * 3.0, rel=1e-12)
    assert res.bubble_fraction == pytest.approx(analytic_bubble(p, m), rel=1e-12, abs=1e-15)
    assert res.busy == [3.0 * m] * p
    assert res.idle == [pytest.approx(res.step_time - 3.0 * m)] * p


@pytest.mark.parametrize("p,m", SIZES)
def test_peak_stash(p: int, m: int) -> None:
    gp = _unit("gpipe", p, m, stash_bytes=[10.0] * p)
    assert gp.peak_stash_count[0] == m
    assert gp.peak_stash_bytes == [10.0 * c for c in gp.peak_stash_count]
    fb = _unit("1f1b", p, m)
    assert fb.peak_stash_count == [min(p - s, m) for s in range(p)]
    assert fb.peak_stash_bytes is None


def test_links_cost_time() -> None:
    free = _unit("1f1b", 4, 8, recompute=False)
    slow = _unit("1f1b", 4, 8, recompute=False, latency=0.5)
    assert slow.step_time > free.step_time
    # 1 MB over 2 MB/s costs the same as a 0.5 s latency.
    bw = _unit("1f1b", 4, 8, recompute=False, send_bytes=[1e6] * 3, bandwidth=2e6)
    assert bw.step_time == pytest.approx(slow.step_time)
    per_link = _unit("1f1b", 4, 8, recompute=False, send_bytes=[1e6] * 3, bandwidth=[2e6, 2e6, 2e6])
    assert per_link.step_time == pytest.approx(slow.step_time)


def test_timeline_respects_order_and_transfers() -> None:
    p, lat = 3, 0.25
    res = _unit("varuna", p, 5, latency=lat)
    ends = {a: e for a, _, e in res.timeline}
    begins = {a: s for a, s, _ in res.timeline}
    assert list(begins.values()) == sorted(begins.values())
    for stage_acts in res.schedule.per_stage:  # one action at a time, in list order
        for before, after in zip(stage_acts, stage_acts[1:]):
            assert ends[before] <= begins[after]
    for act, start, _ in res.timeline:
        if act.kind is Kind.F and act.stage > 0:
            assert start >= ends[Action(act.stage - 1, Kind.F, act.mb)] + lat
        if act.kind is Kind.B and act.stage < p - 1:
            assert start >= ends[Action(act.stage + 1, Kind.B, act.mb)] + lat
    assert max(ends.values()) == res.step_time


def test_recompute_counts_as_busy() -> None:
    res = _unit("varuna", 4, 8)
    assert res.busy == [32.0, 32.0, 32.0, 24.0]
    # recompute defaults to the forward cost
    sched = build_schedule("varuna", 4, 8)
    assert simulate(sched, [1.0] * 4, [2.0] * 4).busy == res.busy


def _late_recomputes(res: SimResult) -> int:
    """How many backwards waited for their own recompute rather than for the gradient."""
    end = {a: e for a, _, e in res.timeline}
    p, m = res.schedule.num_stages, res.schedule.num_micro_batches
    return sum(
        end[Action(s, Kind.R, i)] > end[Action(s + 1, Kind.B, i)]
        for s in range(p - 1)
        for i in range(m)
    )


def test_varuna_recompute_is_off_the_critical_path() -> None:
    # The defining property: R(s, i) overlaps stage s+1's B(s+1, i), so the rebuilt activations
    # are ready when the gradient arrives; 1F1B puts R right before B, where B waits for it.
    for p, m in [(3, 5), (4, 8), (6, 12)]:
        assert _late_recomputes(_unit("varuna", p, m)) == 0
        assert _late_recomputes(_unit("1f1b", p, m)) > 0


def test_varuna_close_to_1f1b_and_never_worse_than_gpipe() -> None:
    # Measured property (see the xfail below): at most one time unit behind 1F1B.
    for p in range(1, 9):
        for m in range(1, 17):
            var = _unit("varuna", p, m).step_time
            assert var <= _unit("gpipe", p, m).step_time
            assert var <= _unit("1f1b", p, m).step_time + 1.0


@pytest.mark.xfail(
    strict=True,
    reason="known: Varuna's greedy B>R>F order is up to one unit "
    "slower than 1F1B on uniform stages (e.g. P=2, m=4: 18 vs 17)",
)
def test_varuna_not_slower_than_1f1b() -> None:
    for p in range(1, 9):
        for m in range(1, 17):
            assert _unit("varuna", p, m).step_time <= _unit("1f1b", p, m).step_time, (p, m)


def test_cache_follows_schedule_edits() -> None:
    sched = build_schedule("gpipe", 2, 2, recompute=False)
    before = simulate(sched, [1.0, 1.0], [2.0, 2.0]).step_time
    sched.per_stage[1] = [Action.parse(t) for t in "1F0 1F1 1B1 1B0".split()]
    after = simulate(sched, [1.0, 1.0], [2.0, 2.0]).step_time
    assert (before, after) == (9.0, 11.0)
    sched.per_stage[1].pop()
    with pytest.raises(ScheduleError, match="missing 1B0"):
        simulate(sched, [1.0, 1.0], [2.0, 2.0])


def test_bad_inputs() -> None:
    sched = build_schedule("1f1b", 3, 4)
    with pytest.raises(ScheduleError, match="forward needs 3"):
        simulate(sched, [1.0] * 2, [2.0] * 3)
    with pytest.raises(ScheduleError, match="send_bytes needs 2"):
        simulate(sched, [1.0] * 3, [2.0] * 3, send_bytes=[1.0] * 3)
    with pytest.raises(ScheduleError, match="bandwidth"):
        simulate(sched, [1.0] * 3, [2.0] * 3, bandwidth=0.0)


def test_analytic_bubble() -> None:
    assert analytic_bubble(1, 7) == 0.0
    assert analytic_bubble(4, 8) == pytest.approx(3 / 11)


def test_text_grid() -> None:
    grid = text_grid(build_schedule("1f1b", 2, 2, recompute=False))
    lines = grid.splitlines()
    assert lines[0].startswith("# 1f1b P=2 m=2 recompute=False; step 9")
    assert lines[2].split() == [
        "stage",
        "0",
        "|",
        "F0",
        "F1",
        ".",
        ".",
        "B0",
        "--",
        ".",
        "B1",
        "--",
    ]
    assert lines[3].split() == [
        "stage",
        "1",
        "|",
        ".",
        "F0",
        "B0",
        "--",
        "F1",
        "B1",
        "--",
        ".",
        ".",
    ]
    # A SimResult with real times renders too (one column = shortest action).
    res = simulate(build_schedule("varuna", 3, 4), [0.5] * 3, [1.0] * 3)
    assert len(text_grid(res).splitlines()) == 5


def test_gantt(tmp_path: Path) -> None:
    path = tmp_path / "g.png"
    fig = gantt(build_schedule("varuna", 3, 4), path=str(path), title="varuna")
    assert path.stat().st_size > 1000
    assert fig.axes[0].get_title() == "varuna"
    res = _unit("1f1b", 2, 3)
    # simulate takes costs in any unit: the axis claims seconds only when told so
    assert gantt(res).axes[0].get_xlabel() == "time (in the units of the simulated costs)"
    assert gantt(res, time_unit="s").axes[0].get_xlabel() == "time (s)"
