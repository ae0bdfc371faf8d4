"""The monitor's timeline chart (matplotlib, drawn on a ``Figure``: no GUI backend is
touched); ``training.png`` is ``training_chart.py``'s.

``timeline.png``: one step as the plan simulated it (its stage costs and schedule,
``schedule/simulate.py``) above the same step as each rank ran it (``pipe.last_step.
timeline``): forward, recompute, backward, weight gradients, sends, waits for a message and the
step's tail (gradient reductions). The two panels share one time axis, in seconds, so the
simulated step's length reads against the measured one's. Each rank's times are from its own
start of the step; in one process every stage runs in turn on one device.
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


def timeline_chart(plan: Plan, measured: Sequence[tuple[str, Sequence[Any]]], path: Path,
                   step: int | None = None) -> Path:
    """``measured``: (row label, that row's TimedActions) per rank, or per stage in one
    process."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    sim = simulated(plan)
    rows = len(measured)
    took = max((a.end for _, row in measured for a in row), default=0.0)
    span = max(took, sim.step_time or 0.0) or 1.0  # the one time axis: the longer step's
    fig = Figure(figsize=(13, 0.55 * (sim.schedule.num_ranks + rows) + 3.2),
                 layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True,
                               height_ratios=[sim.schedule.num_ranks + 1, rows + 1])
    gantt(sim, ax=top, time_unit="s", title=f"simulated by the plan: step "
          f"{sim.step_time * 1e3:.2f} ms (pipeline only; the plan predicts "
          f"{(plan.predicted_step_time or 0) * 1e3:.2f} ms with the reductions)")
    _relabel_simulated(top, sim, span)
    _draw_measured(bottom, measured, span)
    bottom.set_title(f"measured{'' if step is None else f' at step {step}'}: "
                     f"{took * 1e3:.2f} ms", loc="center")
    top.set_xlim(0, span)
    milliseconds = span < 2.0
    for ax, what in ((top, "time"), (bottom, "time from each row's start of the step")):
        ax.tick_params(labelbottom=True)  # (sharex would hide the upper panel's)
        if milliseconds:
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x * 1e3:g}"))
        ax.set_xlabel(f"{what} ({'ms' if milliseconds else 's'})")
    kinds = [k for k in LABELS if any(a.kind == k for _, row in measured for a in row)]
    bottom.legend(handles=[Patch(color=colour(k), label=LABELS[k]) for k in kinds],
                  loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.savefig(path, dpi=130)
    return path


def _labelled(width: float, span: float) -> bool:
    """Whether a bar is wide enough on the shared axis to hold its micro-batch's number."""
    return width / span > 0.012


def _relabel_simulated(ax: Axes, sim: SimResult, span: float) -> None:
    """``gantt`` labelled the bars wide enough against the simulated step alone; on the
    shared axis (a longer measured step) those numbers would overlap: label them again."""
    for text in list(ax.texts):
        text.remove()
    sched = sim.schedule
    for act, start, end in zip(sim.actions, sim.starts, sim.ends):
        if _labelled(end - start, span):
            ax.text((start + end) / 2, sched.rank_of(act.stage),
                    f"{act.stage}:{act.mb}" if sched.is_virtual else str(act.mb), ha="center",
                    va="center", color="white", fontsize=7, fontweight="bold")


def _draw_measured(ax: Axes, measured: Sequence[tuple[str, Sequence[Any]]],
                   span: float) -> None:
    for y, (_, row) in enumerate(measured):
        for a in row:
            width = max(a.end - a.start, span * 1e-4)
            ax.barh(y, width, left=a.start, height=0.8, color=colour(a.kind),
                    edgecolor="white", linewidth=0.4)
            if a.mb >= 0 and a.kind in ("F", "R", "B", "W") and _labelled(width, span):
                ax.text(a.start + width / 2, y, str(a.mb), ha="center", va="center",
                        color="white", fontsize=7, fontweight="bold")
    ax.set_yticks(range(len(measured)), [label for label, _ in measured])
    ax.set_ylim(len(measured) - 0.5, -0.5)
    ax.grid(axis="x", alpha=0.3)
