"""The monitor's charts (matplotlib, drawn on ``Figure`` objects: no GUI backend is touched).

* ``training.png``: loss, throughput and step time (measured beside the plan's prediction)
  over the steps.
* ``timeline.png``: one step as the plan simulated it (its stage costs and schedule,
  ``schedule/simulate.py``) above the same step as each rank ran it (``pipe.last_step.
  timeline``): forward, recompute, backward, weight gradients, sends, waits for a message and
  the step's tail (gradient reductions). Each rank's times are from its own start of the step;
  in one process every stage runs in turn on one device.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..planner.plan import Plan
from ..schedule import Kind, SimResult, simulate, simulate_costs
from ..schedule.render import COLOURS, gantt

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# beyond the compute kinds (render.COLOURS): grey sends, vermilion waits, sky-blue tail
OTHER_COLOURS = {"send": "#999999", "wait": "#D55E00", "sync": "#56B4E9"}
LABELS = {"F": "forward", "R": "recompute", "B": "backward", "W": "weight grads",
          "send": "send", "wait": "wait for a message", "sync": "gradient reductions"}


def colour(kind: str) -> str:
    return OTHER_COLOURS.get(kind) or COLOURS[Kind(kind)]


def simulated(plan: Plan) -> SimResult:
    """The plan's step as the planner's simulator times it from the plan's stage costs."""
    sched = plan.schedule
    if sched.costs is not None:  # the costs its order was made from
        return simulate_costs(sched, sched.costs)
    costs = plan.stage_costs
    forward = [c.forward_time for c in costs]
    backward = [c.backward_time for c in costs]
    if not any(forward) and not any(backward):  # no times recorded: a third forward each
        forward = [c.time / 3 for c in costs]
        backward = [2 * c.time / 3 for c in costs]
    return simulate(sched, forward=forward, backward=backward)


def training_chart(records: Sequence[dict[str, Any]], path: Path) -> Path:
    from matplotlib.figure import Figure

    steps = [r["step"] for r in records]
    fig = Figure(figsize=(10, 8), layout="constrained")
    loss_ax, speed_ax, time_ax = fig.subplots(3, 1, sharex=True)
    loss_ax.plot(steps, [r.get("loss") for r in records], color="#0072B2")
    loss_ax.set_ylabel("loss")
    tokens = [r.get("tokens_per_second") for r in records]
    if any(t is not None for t in tokens):
        speed_ax.plot(steps, tokens, color="#009E73")
        speed_ax.set_ylabel("tokens / s")
    else:
        speed_ax.plot(steps, [r.get("samples_per_second") for r in records], color="#009E73")
        speed_ax.set_ylabel("samples / s")
    time_ax.plot(steps, [r.get("step_seconds") for r in records], color="#D55E00",
                 label="measured (pipe.step)")
    predicted = [r.get("predicted_step_seconds") for r in records]
    if any(p is not None for p in predicted):
        time_ax.plot(steps, predicted, color="#000000", linestyle="--", label="plan's prediction")
    time_ax.set_ylabel("seconds per step")
    time_ax.set_yscale("log")
    time_ax.legend(frameon=False)
    time_ax.set_xlabel("step")
    for ax in (loss_ax, speed_ax, time_ax):
        ax.grid(alpha=0.3)
    fig.suptitle("training")
    fig.savefig(path, dpi=120)
    return path


def timeline_chart(plan: Plan, measured: Sequence[tuple[str, Sequence[Any]]], path: Path,
                   step: int | None = None) -> Path:
    """``measured``: (row label, that row's TimedActions) per rank, or per stage in one
    process."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    sim = simulated(plan)
    rows = len(measured)
    fig = Figure(figsize=(13, 0.55 * (sim.schedule.num_ranks + rows) + 3), layout="constrained")
    top, bottom = fig.subplots(2, 1, height_ratios=[sim.schedule.num_ranks + 1, rows + 1])
    gantt(sim, ax=top, time_unit="s", title=f"simulated by the plan: step "
          f"{sim.step_time * 1e3:.2f} ms (pipeline only; the plan predicts "
          f"{(plan.predicted_step_time or 0) * 1e3:.2f} ms with the reductions)")
    span = _draw_measured(bottom, measured)
    bottom.set_title(f"measured{'' if step is None else f' at step {step}'}: "
                     f"{span * 1e3:.2f} ms", loc="center")
    kinds = [k for k in LABELS if any(a.kind == k for _, row in measured for a in row)]
    bottom.legend(handles=[Patch(color=colour(k), label=LABELS[k]) for k in kinds],
                  loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.savefig(path, dpi=130)
    return path


def _draw_measured(ax: Axes, measured: Sequence[tuple[str, Sequence[Any]]]) -> float:
    span = max((a.end for _, row in measured for a in row), default=0.0) or 1.0
    for y, (_, row) in enumerate(measured):
        for a in row:
            width = max(a.end - a.start, span * 1e-4)
            ax.barh(y, width, left=a.start, height=0.8, color=colour(a.kind),
                    edgecolor="white", linewidth=0.4)
            if a.mb >= 0 and a.kind in ("F", "R", "B", "W") and width / span > 0.012:
                ax.text(a.start + width / 2, y, str(a.mb), ha="center", va="center",
                        color="white", fontsize=7, fontweight="bold")
    ax.set_yticks(range(len(measured)), [label for label, _ in measured])
    ax.set_ylim(len(measured) - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel("time (s) from each row's start of the step")
    ax.grid(axis="x", alpha=0.3)
    return span
