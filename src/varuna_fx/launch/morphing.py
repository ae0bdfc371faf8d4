"""Useful work under preemption: a simulator of a job that checkpoints and morphs.

Varuna's job restarts from the last periodic checkpoint after every preemption: the work since
that checkpoint is lost, and so is the restart ("morph": process restart, capture + plan, load,
first step). With ``pipe.preempted`` (save on SIGTERM/SIGUSR1 within the grace period) nothing
is lost but the save and the morph. This module replays a preemption trace against both, so the
checkpoint interval can be chosen from measured costs (bench/bench_morph.py measures them).

The model, the one of Young (1974) and Daly (2006):
  - the job trains in segments of ``interval`` seconds of work, each followed by a blocking
    checkpoint of ``save_s`` seconds; a segment commits when its checkpoint completes;
  - a preemption at any moment loses the uncommitted work (periodic policy) or, with
    ``policy="on_signal"``, first saves it (``signal_save_s``, which must fit the grace period;
    otherwise the save is cut off and the work is lost as under the periodic policy);
  - then the job morphs for ``morph_s`` seconds; a preemption during the morph restarts it.
Useful-work fraction = work done and not lost / wall time.

For preemptions arriving as a Poisson process of rate ``1/mean_interval`` the periodic policy's
long-run fraction has a closed form (:func:`expected_fraction_periodic`), which the tests check
the simulator against.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

__all__ = ["PreemptionResult", "expected_fraction_periodic", "expected_fraction_on_signal",
           "preemption_trace", "simulate_preemptions", "young_daly_interval"]


def preemption_trace(mean_interval_s: float, horizon_s: float, seed: int = 0) -> list[float]:
    """Preemption times in [0, horizon): a Poisson process with the given mean gap."""
    if mean_interval_s <= 0:
        raise ValueError("mean_interval_s must be positive")
    rng = random.Random(seed)
    times, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / mean_interval_s)
        if t >= horizon_s:
            return times
        times.append(t)


@dataclass
class PreemptionResult:
    horizon_s: float
    useful_s: float  # training work done and kept
    lost_s: float  # training work done, then lost to a preemption
    checkpoint_s: float  # time spent writing checkpoints (periodic and on signal)
    morph_s: float  # time spent restarting (including restarts cut short)
    preemptions: int
    timeline: list[tuple[float, float, str]] = field(default_factory=list)
    """(wall time, useful work kept so far, event) at every change, for charts."""

    @property
    def fraction(self) -> float:
        return self.useful_s / self.horizon_s


def simulate_preemptions(trace: list[float], horizon_s: float, *, interval_s: float | None, save_s: float,
             morph_s: float, policy: str = "periodic", signal_save_s: float | None = None,
             grace_s: float = 30.0, record: bool = False) -> PreemptionResult:
    """Replay ``trace`` (sorted preemption times) for ``horizon_s`` seconds of wall time.

    interval_s: seconds of training between periodic checkpoints; None: no periodic ones
        (sensible only with ``policy="on_signal"``).
    save_s: a periodic checkpoint's blocking time (an async save's copy-out, or a full save).
    signal_save_s: the save on a preemption signal (default ``save_s``).
    """
    if policy not in ("periodic", "on_signal"):
        raise ValueError(f"policy must be 'periodic' or 'on_signal', got {policy!r}")
    if interval_s is not None and interval_s <= 0:
        raise ValueError("interval_s must be positive (or None: no periodic checkpoints)")
    signal_save_s = save_s if signal_save_s is None else signal_save_s
    saves_on_signal = policy == "on_signal" and signal_save_s <= grace_s
    events = [p for p in sorted(trace) if p < horizon_s]
    res = PreemptionResult(horizon_s, 0.0, 0.0, 0.0, 0.0, len(events))
    committed = 0.0  # work safe in a checkpoint
    pending = 0.0  # work done since the last checkpoint
    t, i = 0.0, 0

    def mark(what: str) -> None:
        if record:
            res.timeline.append((t, committed + pending, what))

    mark("start")
    while t < horizon_s:
        nxt = events[i] if i < len(events) else math.inf
        # run: train to the next checkpoint, then write it (or train until stopped)
        todo = math.inf if interval_s is None else interval_s - pending
        end_work = t + todo
        if nxt >= min(end_work, horizon_s):
            if end_work >= horizon_s:  # the horizon falls inside the work
                pending += horizon_s - t
                t = horizon_s
                break
            pending += todo
            t = end_work
            mark("work")
            end_save = t + save_s
            if nxt >= end_save and end_save <= horizon_s:
                committed += pending
                pending = 0.0
                res.checkpoint_s += save_s
                t = end_save
                mark("checkpoint")
                continue
            # preempted (or the horizon reached) while writing: that checkpoint never completes
            stop = min(nxt, horizon_s)
            res.checkpoint_s += stop - t
            t = stop
            if t >= horizon_s:
                break
        else:
            pending += nxt - t
            t = nxt
        # a preemption at t
        i += 1
        if saves_on_signal:
            save_end = min(t + signal_save_s, horizon_s)
            res.checkpoint_s += save_end - t
            t = save_end
            committed += pending
            pending = 0.0
            mark("saved on signal")
        else:
            res.lost_s += pending
            pending = 0.0
            mark("preempted")
        while i < len(events) and events[i] < t:  # signals during the save: the same stop
            i += 1
        # morph; a preemption during it starts it again
        while t < horizon_s:
            done = t + morph_s
            nxt = events[i] if i < len(events) else math.inf
            if nxt >= done:
                res.morph_s += min(done, horizon_s) - t
                t = min(done, horizon_s)
                break
            res.morph_s += nxt - t
            t = nxt
            i += 1
        mark("morphed")
    res.useful_s = committed + pending
    mark("end")
    return res


def expected_fraction_periodic(mean_interval_s: float, interval_s: float, save_s: float,
                               morph_s: float) -> float:
    """Long-run useful fraction of the periodic policy under Poisson preemptions (Daly 2006):
    a segment of ``interval_s`` work and ``save_s`` checkpoint takes, in expectation,
    ``exp(lam * morph) * (exp(lam * (interval + save)) - 1) / lam`` wall seconds."""
    lam = 1.0 / mean_interval_s
    wall = math.exp(lam * morph_s) * math.expm1(lam * (interval_s + save_s)) / lam
    return interval_s / wall


def expected_fraction_on_signal(mean_interval_s: float, interval_s: float | None, save_s: float,
                                morph_s: float, signal_save_s: float | None = None) -> float:
    """Long-run useful fraction when every preemption saves first (nothing lost): a cycle is a
    run of Exp(lam) seconds (training and periodic checkpoints), the signal save and a morph
    (restarted by preemptions during it)."""
    lam = 1.0 / mean_interval_s
    signal_save_s = save_s if signal_save_s is None else signal_save_s
    morph_wall = math.expm1(lam * morph_s) / lam  # expected time to finish an uninterrupted morph
    # a run between stops lasts Exp(lam) and starts with a full segment of work (the signal
    # save reset it): expected work in it, summed over the segments it reaches
    if interval_s is None:
        work = 1.0 / lam
    else:
        work = -math.expm1(-lam * interval_s) / (lam * -math.expm1(-lam * (interval_s + save_s)))
    return work / (1.0 / lam + signal_save_s + morph_wall)


def young_daly_interval(mean_interval_s: float, save_s: float) -> float:
    """Young's first-order optimal checkpoint interval sqrt(2 * C * MTBF)."""
    return math.sqrt(2.0 * save_s * mean_interval_s)
