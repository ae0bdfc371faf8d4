"""The preemption simulator: hand-checked traces and the closed forms it must converge to."""

from __future__ import annotations

import pytest

from varuna_fx.launch.morphing import (
    expected_fraction_on_signal,
    expected_fraction_periodic,
    preemption_trace,
    simulate_preemptions,
    young_daly_interval,
)


def test_no_preemptions_costs_only_checkpoints() -> None:
    r = simulate_preemptions([], 1100.0, interval_s=100.0, save_s=10.0, morph_s=5.0)
    assert r.fraction == pytest.approx(100 / 110)
    assert r.checkpoint_s == pytest.approx(100.0) and r.morph_s == 0 and r.lost_s == 0
    free = simulate_preemptions([], 1000.0, interval_s=None, save_s=10.0, morph_s=5.0, policy="on_signal")
    assert free.fraction == 1.0


def test_hand_checked_trace() -> None:
    # work 0-10, save 10-11 (10 kept), work 11-15, preempted at 15: 4 lost, morph 15-17,
    # work 17-27, save 27-28 (20 kept), work 28-30
    r = simulate_preemptions([15.0], 30.0, interval_s=10.0, save_s=1.0, morph_s=2.0, record=True)
    assert (r.useful_s, r.lost_s, r.morph_s, r.checkpoint_s) == (22.0, 4.0, 2.0, 2.0)
    assert [e for _, _, e in r.timeline][:4] == ["start", "work", "checkpoint", "preempted"]
    # save on signal: 15-16 save (14 kept), morph 16-18, work 18-28, save 28-29 (24), work 29-30
    s = simulate_preemptions([15.0], 30.0, interval_s=10.0, save_s=1.0, morph_s=2.0, policy="on_signal")
    assert (s.useful_s, s.lost_s, s.morph_s, s.checkpoint_s) == (25.0, 0.0, 2.0, 3.0)
    # a preemption during the morph restarts it; one during a save voids that checkpoint
    m = simulate_preemptions([15.0, 16.0], 30.0, interval_s=10.0, save_s=1.0, morph_s=2.0)
    assert m.morph_s == 3.0 and m.useful_s == 21.0
    v = simulate_preemptions([10.5], 30.0, interval_s=10.0, save_s=1.0, morph_s=2.0)
    assert v.lost_s == 10.0 and v.checkpoint_s == pytest.approx(1.5)


def test_signal_save_longer_than_grace_loses_the_work() -> None:
    kw = dict(interval_s=10.0, save_s=1.0, morph_s=2.0, signal_save_s=40.0, grace_s=30.0)
    assert simulate_preemptions([15.0], 30.0, policy="on_signal", **kw).useful_s == \
        simulate_preemptions([15.0], 30.0, policy="periodic", **kw).useful_s


@pytest.mark.parametrize("mean", [600.0, 3600.0])
@pytest.mark.parametrize("interval", [60.0, 600.0])
def test_poisson_matches_closed_forms(mean: float, interval: float) -> None:
    horizon = mean * 2000  # ~2000 preemptions: sampling error under 1%
    trace = preemption_trace(mean, horizon, seed=1)
    assert len(trace) == pytest.approx(2000, rel=0.1)
    kw = dict(interval_s=interval, save_s=5.0, morph_s=10.0)
    got = simulate_preemptions(trace, horizon, **kw).fraction
    assert got == pytest.approx(expected_fraction_periodic(mean, **kw), abs=0.01)
    sig = simulate_preemptions(trace, horizon, policy="on_signal", **kw).fraction
    assert sig == pytest.approx(expected_fraction_on_signal(mean, **kw), abs=0.003)
    assert sig > got  # nothing lost beats redoing work


def test_young_daly_interval_is_near_the_best() -> None:
    mean, save, morph = 600.0, 5.0, 10.0
    best = young_daly_interval(mean, save)
    grid = [10.0 * k for k in range(1, 120)]
    top = max(grid, key=lambda t: expected_fraction_periodic(mean, t, save, morph))
    assert abs(top - best) / best < 0.2
    with pytest.raises(ValueError):
        simulate_preemptions([], 10.0, interval_s=0.0, save_s=1.0, morph_s=1.0)
    with pytest.raises(ValueError):
        simulate_preemptions([], 10.0, interval_s=1.0, save_s=1.0, morph_s=1.0, policy="never")
