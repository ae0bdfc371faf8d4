"""``charts/training.png``: a run over its steps, for a person to read (matplotlib, drawn on a
``Figure``: no GUI backend is touched).

Panels, top to bottom (one is left out when the records hold nothing for it):

* loss: each step's (thin, light) with an exponential moving average over it (debiased, as
  TensorBoard smooths; its span grows with the run) and the validation loss (``val_loss``)
  as points joined by a line;
* learning rate and the gradients' global norm (``lr``, ``grad_norm``: the scalars the train
  command logs; a script passes them to ``monitor.log``), the norm on the right-hand axis;
* throughput (tokens/s, else samples/s) and MFU on the right-hand axis -- named an estimate
  against the assumed peak when the device has no datasheet figure (every CPU);
* seconds per step as measured beside the plan's prediction (log scale).

Every panel carries the run's marks (``history.marks``): a dashed vertical line before the
first step after a resume (saying so when it came back on another layout), an in-place morph or
a restart, numbered above the loss panel; a legend under the panels says what each number is.
The loss is drawn on a log scale when it falls by more than 20x (the end of a run is where a
person looks, and a linear scale flattens it).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .flops import flops_text
from .history import Mark, assumed_peak, val_points

if TYPE_CHECKING:
    from matplotlib.axes import Axes

BLUE, ORANGE, GREEN, VERMILION, PURPLE, GREY = ("#0072B2", "#E69F00", "#009E73", "#D55E00",
                                                "#CC79A7", "#555555")
MARK_COLOURS = {"resume": GREY, "morph": PURPLE, "restart": VERMILION}
MAX_MARK_LABELS = 8  # more marks are drawn, only so many explained in the legend
LOG_LOSS_RATIO = 20.0  # a loss falling by more than this is drawn on a log scale


def ema(values: Sequence[float | None], span: int) -> list[float | None]:
    """The debiased exponential moving average of ``values`` over about ``span`` points
    (``alpha = 2 / (span + 1)``); None where the value is missing (the average carries on)."""
    alpha = 2.0 / (span + 1)
    out: list[float | None] = []
    mean, weight = 0.0, 0.0
    for value in values:
        if value is None:
            out.append(None)
            continue
        mean = (1 - alpha) * mean + alpha * value
        weight = (1 - alpha) * weight + alpha  # the bias of a mean started at 0
        out.append(mean / weight)
    return out


def smoothing_span(points: int) -> int:
    """About a fifteenth of the run, from 3 to 200 steps; 1 (none) under 10 points."""
    return 1 if points < 10 else max(3, min(200, points // 15))


def _column(records: Sequence[dict[str, Any]], key: str) -> list[float | None]:
    values = [r.get(key) for r in records]
    return [float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None
            for v in values]


def _has(values: Sequence[float | None]) -> bool:
    return any(v is not None for v in values)


def training_chart(records: Sequence[dict[str, Any]], path: Path,
                   events: Sequence[dict[str, Any]] = (), marks: Sequence[Mark] = (),
                   title: str = "training") -> Path:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in records]
    lr, norm = _column(records, "lr"), _column(records, "grad_norm")
    optimizer_panel = _has(lr) or _has(norm)
    panels = 4 if optimizer_panel else 3
    fig = Figure(figsize=(11, 2.6 * panels + 0.6), layout="constrained")
    axes = list(fig.subplots(panels, 1, sharex=True))
    loss_ax, speed_ax, time_ax = axes[0], axes[-2], axes[-1]
    _loss(loss_ax, steps, records, events)
    if optimizer_panel:
        _optimizer(axes[1], steps, lr, norm)
    _speed(speed_ax, steps, records)
    _times(time_ax, steps, records)
    time_ax.set_xlabel("step")
    time_ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    if steps:  # a little room either side: a mark before the first step stays visible
        time_ax.set_xlim(min(steps) - 0.5 - 0.01 * len(steps),
                         max(steps) + 0.5 + 0.01 * len(steps))
    for ax in axes:
        ax.grid(alpha=0.3)
    _marks(fig, axes, marks)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return path


def _loss(ax: Axes, steps: list[int], records: Sequence[dict[str, Any]],
          events: Sequence[dict[str, Any]]) -> None:
    loss = _column(records, "loss")
    span = smoothing_span(sum(v is not None for v in loss))
    if span > 1:
        ax.plot(steps, loss, color=BLUE, alpha=0.4, linewidth=1.0, label="loss (each step)")
        ax.plot(steps, ema(loss, span), color=BLUE, linewidth=1.8,
                label=f"loss, moving average over ~{span} steps")
    else:
        ax.plot(steps, loss, color=BLUE, linewidth=1.5, marker="." if len(steps) < 50 else "",
                label="loss")
    val = val_points(list(records), list(events))
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], color=ORANGE, marker="o",
                markersize=4, linewidth=1.5, label="validation loss")
    ax.set_ylabel("loss")
    seen = [v for v in loss if v is not None] + [v for _, v in val]
    if seen and min(seen) > 0 and max(seen) / min(seen) > LOG_LOSS_RATIO:
        ax.set_yscale("log")
        ax.set_ylabel("loss (log scale)")
    ax.legend(frameon=False, loc="best", fontsize=8)  # (where it hides the least)


def _optimizer(ax: Axes, steps: list[int], lr: list[float | None],
               norm: list[float | None]) -> None:
    handles = []
    if _has(lr):
        handles += ax.plot(steps, lr, color=GREEN, linewidth=1.5, label="learning rate")
        ax.set_ylabel("learning rate")
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    right = ax.twinx() if _has(lr) else ax
    if _has(norm):
        handles += right.plot(steps, norm, color=VERMILION, linewidth=1.0, alpha=0.8,
                              label="gradient norm (before clipping)")
        right.set_ylabel("gradient norm")
    ax.legend(handles=handles, frameon=False, loc="upper right", fontsize=8)


def _speed(ax: Axes, steps: list[int], records: Sequence[dict[str, Any]]) -> None:
    tokens = _column(records, "tokens_per_second")
    if _has(tokens):
        handles = ax.plot(steps, tokens, color=GREEN, linewidth=1.2, label="tokens / s")
        ax.set_ylabel("tokens / s")
    else:
        handles = ax.plot(steps, _column(records, "samples_per_second"), color=GREEN,
                          linewidth=1.2, label="samples / s")
        ax.set_ylabel("samples / s")
    ax.set_ylim(bottom=0)
    mfu = [None if v is None else 100 * v for v in _column(records, "mfu")]
    if _has(mfu):
        _mfu_axis(ax, steps, tokens if _has(tokens) else _column(records, "samples_per_second"),
                  mfu, records, handles)
    ax.legend(handles=handles, frameon=False, loc="lower right", fontsize=8)


def _mfu_axis(ax: Axes, steps: list[int], speed: list[float | None], mfu: list[float | None],
              records: Sequence[dict[str, Any]], handles: list[Any]) -> None:
    """MFU on the right: a second scale of the throughput line when the two are proportional
    (one layout: the same FLOPs per token and devices), else a line of its own."""
    assumed = assumed_peak(records)
    label = "MFU (%)" if assumed is None else \
        f"MFU (%), an estimate:\nassumed peak {flops_text(assumed)}/device"
    ratios = [m / t for t, m in zip(speed, mfu) if t and m is not None]
    if ratios and max(ratios) - min(ratios) <= 1e-6 * max(ratios):
        k = statistics.median(ratios)
        right = ax.secondary_yaxis("right", functions=(lambda t: t * k, lambda m: m / k))
    else:
        right = ax.twinx()
        handles += right.plot(steps, mfu, color=GREY, linewidth=0.9, alpha=0.8,
                              label=label.replace("\n", " "))
        right.set_ylim(bottom=0)
    right.set_ylabel(label, fontsize=8 if assumed else None)


def _times(ax: Axes, steps: list[int], records: Sequence[dict[str, Any]]) -> None:
    ax.plot(steps, _column(records, "step_seconds"), color=VERMILION, linewidth=1.2,
            label="measured (pipe.step)")
    predicted = _column(records, "predicted_step_seconds")
    if _has(predicted):
        ax.plot(steps, predicted, color="#000000", linestyle="--", linewidth=1.2,
                label="plan's prediction")
    ax.set_ylabel("seconds per step")
    ax.set_yscale("log")
    ax.legend(frameon=False, loc="best", fontsize=8)  # (where it hides the least)


def _marks(fig: Any, axes: list[Axes], marks: Sequence[Mark]) -> None:
    """A dashed line on every panel before each mark's step, its number above the top panel;
    under the panels a legend: the number, the step and what happened."""
    from matplotlib.lines import Line2D

    handles = []
    for n, mark in enumerate(marks, 1):
        colour = MARK_COLOURS.get(mark.kind, GREY)
        for ax in axes:
            ax.axvline(mark.step - 0.5, color=colour, linestyle="--", linewidth=1.0, alpha=0.9)
        axes[0].text(mark.step - 0.5, 1.01, str(n), ha="center", va="bottom", fontsize=8,
                     fontweight="bold", color=colour, clip_on=False,
                     transform=axes[0].get_xaxis_transform())
        if n <= MAX_MARK_LABELS:
            handles.append(Line2D([], [], color=colour, linestyle="--",
                                  label=f"{n}: before step {mark.step}, {mark.label}"))
    if not handles:
        return
    if len(marks) > MAX_MARK_LABELS:
        handles.append(Line2D([], [], color="none",
                              label=f"(+{len(marks) - MAX_MARK_LABELS} more marks)"))
    fig.legend(handles=handles, loc="outside lower center", ncols=1 if len(handles) < 4 else 2,
               frameon=False, fontsize=8)
