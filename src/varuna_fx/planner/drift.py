"""The plan learns whether it was right: after the first steps, the measured step against the
prediction, and the cost term that was off.

``pipe.step`` hands each step's wall seconds and this process's action timeline
(``runtime/step_stats.py``: (stage, kind, micro-batch, start, end) per action, send, wait and
the step's tail "sync") to a :class:`DriftCheck`. It skips the first step (warm-up: lazy
allocations, connections), takes the median of the next ``STEPS``, and when that differs from
``plan.predicted_step_time`` by more than ``TOLERANCE`` it says so once (only for a plan priced
with this machine's costs, ``Plan.priced_here``, running as planned: one process running
several stages in turn is not the pipeline predicted), naming the term of
the cost model (``Plan.cost_terms``) whose measured share is furthest from its predicted one:

* **compute**: this process's F/R/B/W actions (their operations and the fixed cost per action)
  against its stages' predicted busy seconds (``Plan.stage_busy``) times the micro-batches;
* **all-reduce**: the step's tail ("sync") against the predicted all-reduce;
* **messages and bubble**: the rest of the step (sends and waits for messages) against the
  predicted rest.

Without a timeline (``record_timeline = False``) the largest predicted term is named as the
likeliest one.

It speaks on rank 0 only (``speaks``): every rank of a job runs the same step against the same
plan, so one warning per job says it; the other ranks' steps are their own data and stay in
``pipe.last_step`` and the monitor's per-rank records.
"""

from __future__ import annotations

from collections.abc import Sequence

from .plan import Plan

TOLERANCE = 0.20  # relative: a measured step further than this from the prediction is said
STEPS = 3  # steps after the first whose median is compared
COMPUTE_KINDS = ("F", "R", "B", "W")

Timeline = Sequence[tuple[int, str, int, float, float]]


class DriftCheck:
    """Watches a pipeline's first steps against its plan (once: then it is quiet)."""

    def __init__(self, plan: Plan, runs_as_planned: bool = True, speaks: bool = True) -> None:
        """``runs_as_planned``: the run is the one the plan predicts (each stage on its own
        rank; not several stages taking turns in one process). ``speaks``: this process
        gives the job's one warning (rank 0; the others stay quiet)."""
        self.plan = plan
        self.seen = 0
        self.samples: list[tuple[float, Timeline]] = []
        # only a prediction made with this machine's costs, for the layout that runs, and
        # said once per job: by rank 0
        self.done = plan.predicted_step_time is None or not plan.priced_here or \
            not runs_as_planned or not speaks

    def observe(self, seconds: float, timeline: Timeline = ()) -> str | None:
        """The warning to give after this step, or None (at most one, ever)."""
        if self.done:
            return None
        self.seen += 1
        if self.seen == 1:
            return None  # warm-up
        self.samples.append((seconds, tuple(timeline)))
        if len(self.samples) < STEPS:
            return None
        self.done = True
        ordered = sorted(self.samples, key=lambda s: s[0])
        measured, line = ordered[len(ordered) // 2]
        return drift_message(self.plan, measured, line)


def drift_message(plan: Plan, measured: float, timeline: Timeline = ()) -> str | None:
    """None when ``measured`` is within ``TOLERANCE`` of the prediction; else what was off."""
    predicted = plan.predicted_step_time
    if predicted is None or predicted <= 0 or measured <= 0:
        return None
    if abs(measured / predicted - 1) <= TOLERANCE:
        return None
    term, got, want = off_term(plan, measured, timeline)
    detail = f" (measured {_ms(got)}, predicted {_ms(want)})" if got is not None else ""
    return (f"the step took {_ms(measured)} against the plan's predicted {_ms(predicted)} "
            f"({measured / predicted - 1:+.0%}); the cost model's term furthest off: "
            f"{term}{detail}. Plan with this machine's measurements (profile=True; a machine "
            "shared with other jobs also slows every step), or compare the plan's "
            "alternatives by timing them (bench/bench_planner_truth.py)")


def off_term(plan: Plan, measured: float, timeline: Timeline = ()
             ) -> tuple[str, float | None, float | None]:
    """(the term, its measured seconds, its predicted seconds) that is furthest off."""
    terms = dict(plan.cost_terms)
    if not timeline:
        name = max(terms, key=lambda k: terms[k]) if terms else "compute"
        return f"{name} (the largest predicted; no timeline recorded)", None, None
    stages = sorted({s for s, kind, *_ in timeline if kind in COMPUTE_KINDS})
    compute = sum(end - start for _, kind, _, start, end in timeline if kind in COMPUTE_KINDS)
    sync = sum(end - start for _, kind, _, start, end in timeline if kind == "sync")
    m = plan.num_micro_batches
    want_compute = sum(plan.stage_busy[s] for s in stages if s < len(plan.stage_busy)) * m
    want_sync = terms.get("all-reduce", 0.0)
    assert plan.predicted_step_time is not None
    rows = [("compute (F/R/B operations and each action's fixed cost)", compute, want_compute),
            ("all-reduce", sync, want_sync),
            ("messages and bubble (sends and waits)", max(measured - compute - sync, 0.0),
             max(plan.predicted_step_time - want_compute - want_sync, 0.0))]
    return max(rows, key=lambda r: abs(r[1] - r[2]))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
