"""bench_planner_truth.py's pure parts: a step's decomposition from its timeline against the
plan's cost terms, the rank correlation and the report's tables. No torch, nothing launched
(tests/test_bench_planner_truth.py).

A step is split four ways, measured and predicted alike:

* **compute**: the F/R/B/W actions (their operations and each action's fixed cost), against
  the plan's ``compute`` + ``action overhead`` (the busiest stage's);
* **sync**: the step's tail (gradient reductions and the waits for them), against
  ``all-reduce``;
* **messages + waits**: sends and the waits for messages, against ``messages`` + ``bubble``
  (a wait is either a message in flight or the pipeline's fill and drain);
* **outside**: the step's wall time outside every recorded action (the pipeline's own Python
  around the schedule: binding inputs, splitting micro-batches, posting receives, the meter;
  and the step's closing world all-reduce of the loss and flags, ``finish`` in
  ``runtime/distributed.py``, with its wait for the last rank), against any term the plan
  lists that is none of the above (the cost model prices nothing there today: 0).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

PARTS = ("compute", "sync", "comm", "outside")
LABELS = {"compute": "compute", "sync": "sync", "comm": "messages+waits", "outside": "outside"}
COMPUTE_KINDS = frozenset("FRBW")
COMM_KINDS = frozenset(("send", "wait"))

Timeline = Iterable[Sequence[Any]]  # (stage, kind, mb, start, end) per action


def decompose(wall: float, timeline: Timeline) -> dict[str, float]:
    """One rank's step of ``wall`` seconds split by its timeline (``pipe.last_step.timeline``):
    seconds of compute, sync, messages + waits, and outside the actions (never negative)."""
    out = dict.fromkeys(PARTS, 0.0)
    for _, kind, _, start, end in timeline:
        part = "compute" if kind in COMPUTE_KINDS else "sync" if kind == "sync" else \
            "comm" if kind in COMM_KINDS else None
        if part is not None:
            out[part] += end - start
    out["outside"] = max(wall - out["compute"] - out["sync"] - out["comm"], 0.0)
    out["wall"] = wall
    return out


def predicted_parts(cost_terms: Mapping[str, float] | Iterable[tuple[str, float]]
                    ) -> dict[str, float]:
    """The plan's cost terms (``plan.cost_terms``) in the four parts of :func:`decompose`;
    a term of another name (a cost the model may add) counts as outside the actions."""
    items = cost_terms.items() if isinstance(cost_terms, Mapping) else cost_terms
    out = dict.fromkeys(PARTS, 0.0)
    for name, seconds in items:
        low = name.lower()
        if "compute" in low or "action" in low:
            out["compute"] += seconds
        elif "all-reduce" in low or "allreduce" in low or "sync" in low:
            out["sync"] += seconds
        elif "message" in low or "bubble" in low or "wait" in low:
            out["comm"] += seconds
        else:
            out["outside"] += seconds
    return out


def slowest_rank(per_rank: Sequence[Mapping[str, float]]) -> Mapping[str, float]:
    """The rank whose compute is largest (the busiest stage: what the plan's terms describe)."""
    return max(per_rank, key=lambda r: r["compute"])


def median_step(steps: Sequence[Mapping[str, float]]) -> Mapping[str, float]:
    """The decomposition of the median step by wall time (its parts add up to its wall)."""
    ordered = sorted(steps, key=lambda s: s["wall"])
    return ordered[len(ordered) // 2]


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    if len(a) < 2:
        return float("nan")
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var > 0 else float("nan")


def furthest_off(measured: Mapping[str, float], predicted: Mapping[str, float]) -> str:
    """The part whose measured seconds are furthest from its predicted ones."""
    return LABELS[max(PARTS, key=lambda p: abs(measured[p] - predicted[p]))]


def decomposition_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per row, measured / predicted ms of each part on the slowest rank, the part furthest
    off; then the median of measured - predicted per part over the rows."""
    lines = ["| P | D | b x m | schedule | " + " | ".join(
        f"{LABELS[p]} ms" for p in PARTS) + " | furthest off |",
        "| ---: | ---: | ---: | --- | " + " | ".join("---:" for _ in PARTS) + " | --- |"]
    gaps: dict[str, list[float]] = {p: [] for p in PARTS}
    for r in rows:
        if not r.get("ranks"):
            continue
        got, want = slowest_rank(r["ranks"]), predicted_parts(r["terms"])
        for p in PARTS:
            gaps[p].append(got[p] - want[p])
        cells = " | ".join(f"{got[p] * 1e3:.1f} / {want[p] * 1e3:.1f}" for p in PARTS)
        lines.append(f"| {r['P']} | {r['D']} | {r['b']} x {r['m']} | {r['schedule']} | {cells} "
                     f"| {furthest_off(got, want)} |")
    if not gaps["compute"]:
        return []
    lines.append("")
    lines.append("- measured - predicted, median over the rows: " + ", ".join(
        f"{LABELS[p]} {statistics.median(gaps[p]) * 1e3:+.1f} ms" for p in PARTS))
    return lines


def model_report(name: str, got: Mapping[str, Any], setting: str) -> tuple[list[str],
                                                                          list[float],
                                                                          list[float]]:
    """One model's tables (predicted against measured, then the decomposition) and its
    |errors| (wall, load-normalised)."""
    rows, pick = got["rows"], got["pick"]
    best = min(rows, key=lambda r: r["measured"])
    lines = [f"**{name}** ({setting})\n",
             "| P | D | b x m | schedule | predicted ms | measured ms | error "
             "| load-normalised ms | error |",
             "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    errors, normal = [], []
    for r in rows:
        e = r["predicted"] / r["measured"] - 1
        n = r["predicted"] / r["normal"] - 1
        errors.append(abs(e))
        normal.append(abs(n))
        mark = " (best)" if r is best else ""
        lines.append(f"| {r['P']} | {r['D']} | {r['b']} x {r['m']} | {r['schedule']}{mark} "
                     f"| {r['predicted'] * 1e3:.1f} | {r['measured'] * 1e3:.1f} "
                     f"| {e:+.1%} | {r['normal'] * 1e3:.1f} | {n:+.1%} |")
    rho = spearman([r["predicted"] for r in rows], [r["measured"] for r in rows])
    rho_n = spearman([r["predicted"] for r in rows], [r["normal"] for r in rows])
    gap = pick["measured"] / best["measured"] - 1
    lines += ["",
              f"- wall: median |error| {statistics.median(errors):.1%}, max "
              f"{max(errors):.1%}, Spearman {rho:.2f} over {len(rows)} configurations",
              f"- load-normalised: median |error| {statistics.median(normal):.1%}, max "
              f"{max(normal):.1%}, Spearman {rho_n:.2f}",
              f"- compile's defaults picked P={pick['P']} D={pick['D']} b={pick['b']} "
              f"({pick['schedule']}), predicted {pick['predicted'] * 1e3:.1f} ms, "
              f"measured {pick['measured'] * 1e3:.1f} ms: {gap:+.1%} vs the best "
              f"measured (P={best['P']} D={best['D']} b={best['b']} {best['schedule']})", ""]
    parts = decomposition_table(rows)
    if parts:
        lines += [f"Where the step went, {name}: measured / predicted ms on the slowest rank "
                  "(the most compute), the median step; predicted from `plan.cost_terms` "
                  "(compute + action overhead; all-reduce; messages + bubble; outside the "
                  "actions: unpriced)\n", *parts, ""]
    return lines, errors, normal


def report(data: Mapping[str, Mapping[str, Any]], setting: str) -> str:
    """Every model's tables, then the errors over all of them."""
    lines: list[str] = []
    all_errors: list[float] = []
    all_normal: list[float] = []
    for name, got in data.items():
        if name.startswith("_"):
            continue  # the run's own facts (links measured), not a model
        text, errors, normal = model_report(name, got, setting)
        lines += text
        all_errors += errors
        all_normal += normal
    if all_errors:
        lines.append(f"All models, wall: median |error| {statistics.median(all_errors):.1%}, "
                     f"max {max(all_errors):.1%} over {len(all_errors)} configurations; "
                     f"load-normalised: median {statistics.median(all_normal):.1%}, "
                     f"max {max(all_normal):.1%}.")
    return "\n".join(lines)


def links_line(links: Mapping[str, Any] | None) -> str:
    """What the link probe measured (the planner's kept links), in words."""
    if not links:
        return "The planner's links: none kept (not measured)."
    bw = [b * 8 / 1e6 for b in links.get("link_bandwidths", ())]
    per_link = f" (per link r -> r + 1: {', '.join(f'{b:.0f}' for b in bw)})" if bw else ""
    return (f"The planner's links, as its probe measured them: latency "
            f"{links['latency'] * 1e6:.0f} us, bandwidth {links['bandwidth'] * 8 / 1e6:.0f} "
            f"Mbit/s{per_link}, all-reduce {links['allreduce_bandwidth'] * 8 / 1e6:.0f} Mbit/s, "
            f"latency {links['allreduce_latency'] * 1e6:.0f} us.")
