"""Human views of a schedule: a terminal grid and a matplotlib Gantt chart.

Both accept a :class:`Schedule` (timed with unit costs F=R=1, B=2 and free links, which is how
the schedules are usually drawn in papers) or a :class:`SimResult` (real simulated times).
A virtual schedule (ranks running several stages) is drawn one row per rank, each cell naming
its stage (``2F0``).
Matplotlib is drawn through ``matplotlib.figure.Figure`` directly, never pyplot, so no GUI
backend is touched and this works on headless machines and inside test runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from varuna_fx.schedule.actions import Action, Kind, Schedule
from varuna_fx.schedule.simulate import SimResult, simulate

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# Colour-blind-safe (Okabe-Ito): forward blue, recompute orange, backward green, and the
# weight-gradient part of a split backward reddish purple.
COLOURS = {Kind.F: "#0072B2", Kind.R: "#E69F00", Kind.B: "#009E73", Kind.W: "#CC79A7"}
_LABELS = {Kind.F: "forward", Kind.R: "recompute", Kind.B: "backward", Kind.W: "weight grads"}


def _as_sim(obj: Schedule | SimResult) -> SimResult:
    if isinstance(obj, SimResult):
        return obj
    p = obj.num_stages
    return simulate(obj, forward=[1.0] * p, backward=[2.0] * p, recompute=[1.0] * p)


def _grid_cells(sim: SimResult) -> tuple[list[list[str]], float]:
    """Per-stage lists of cell labels; one column is the shortest action's duration."""
    durations = [e - s for s, e in zip(sim.starts, sim.ends) if e > s]
    unit = min(durations) if durations else 1.0
    ncols = round(sim.step_time / unit) if sim.step_time > 0 else 0
    sched = sim.schedule
    rows: list[list[str]] = [[""] * ncols for _ in range(sched.num_ranks)]
    for act, start, end in zip(sim.actions, sim.starts, sim.ends):
        first = round(start / unit)
        stop = max(first + 1, round(end / unit))
        row = rows[sched.rank_of(act.stage)]
        row[first] = str(act) if sched.is_virtual else action_label(act)
        for c in range(first + 1, min(stop, ncols)):
            row[c] = "-"  # continuation of a multi-slot action (e.g. a backward)
    return rows, unit


def text_grid(obj: Schedule | SimResult) -> str:
    """One row per stage, one column per time slot; ``.`` marks an idle slot."""
    sim = _as_sim(obj)
    rows, unit = _grid_cells(sim)
    width = max([len(c) for row in rows for c in row] + [2])
    sched = sim.schedule
    lines = [
        f"# {sched.name} P={sched.num_stages} m={sched.num_micro_batches} "
        f"recompute={sched.recompute}; step {sim.step_time:g}, 1 column = {unit:g}, "
        f"bubble {sim.bubble_fraction:.1%}"
    ]
    ncols = len(rows[0]) if rows else 0
    ticks = [str(c).ljust(width) if c % 5 == 0 else " " * width for c in range(ncols)]
    lines.append("time    | " + " ".join(ticks).rstrip())
    label = "rank " if sched.is_virtual else "stage"
    for s, row in enumerate(rows):
        cells = [(c or ".").ljust(width) if c != "-" else "-" * width for c in row]
        lines.append(f"{label} {s:<2}| " + " ".join(cells).rstrip())
    return "\n".join(lines) + "\n"


def _draw(ax: Axes, sim: SimResult, xlabel: str) -> None:
    sched = sim.schedule
    p = sched.num_ranks
    span = sim.step_time or 1.0
    for act, start, end in zip(sim.actions, sim.starts, sim.ends):
        width = end - start
        row = sched.rank_of(act.stage)
        ax.barh(
            row,
            width,
            left=start,
            height=0.8,
            color=COLOURS[act.kind],
            edgecolor="white",
            linewidth=0.6,
        )
        # Label only bars wide enough to hold the number legibly.
        if width / span > 0.008:
            ax.text(
                start + width / 2,
                row,
                f"{act.stage}:{act.mb}" if sched.is_virtual else str(act.mb),
                ha="center",
                va="center",
                color="white",
                fontsize=_fontsize(width / span),
                fontweight="bold",
            )
    ax.set_yticks(range(p), [f"{'rank' if sched.is_virtual else 'stage'} {s}"
                             for s in range(p)])
    ax.set_ylim(p - 0.5, -0.5)  # stage 0 on top, as pipelines are usually drawn
    ax.set_xlim(0, span)
    ax.set_xlabel(xlabel)
    ax.grid(axis="x", alpha=0.3)


def _fontsize(rel_width: float) -> float:
    return max(5.0, min(9.0, rel_width * 400))


def _legend(ax: Axes, sim: SimResult) -> None:
    from matplotlib.patches import Patch

    kinds = [k for k in Kind if any(a.kind is k for a in sim.actions)]
    handles = [Patch(color=COLOURS[k], label=_LABELS[k]) for k in kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def gantt(
    obj: Schedule | SimResult,
    path: str | None = None,
    title: str | None = None,
    ax: Axes | None = None,
    time_unit: str | None = None,
) -> Figure:
    """Gantt chart of one step: a row per stage, micro-batch numbers on the bars.

    Draws into ``ax`` when given (to stack several schedules in one figure), else into a new
    figure; saves it to ``path`` (format from the suffix) when given, and returns the figure.
    ``time_unit`` labels the time axis (e.g. ``"s"`` when the simulated costs were seconds);
    without it the axis names no unit, since :func:`simulate` takes costs in any unit.
    """
    from matplotlib.figure import Figure

    sim = _as_sim(obj)
    if ax is None:
        p = sim.schedule.num_ranks
        fig = Figure(figsize=(12, 0.5 * p + 1.5), layout="constrained")
        ax = fig.add_subplot()
    fig = ax.figure
    if time_unit is not None:
        xlabel = f"time ({time_unit})"
    elif isinstance(obj, SimResult):
        xlabel = "time (in the units of the simulated costs)"
    else:
        xlabel = "time (units: F=R=1, B=2)"
    _draw(ax, sim, xlabel)
    _legend(ax, sim)
    sched = sim.schedule
    ax.set_title(
        title
        or f"{sched.name}: P={sched.num_stages}, m={sched.num_micro_batches}, "
        f"step {sim.step_time:g}, bubble {sim.bubble_fraction:.1%}"
    )
    if path is not None:
        fig.savefig(path, dpi=150)
    return fig


def action_label(act: Action) -> str:
    """Grid/Gantt cell text of an action (kind and micro-batch; the row gives the stage)."""
    return f"{act.kind.value}{act.mb}"
