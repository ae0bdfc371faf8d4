"""``varuna-fx report RUN_DIR``: a run's charts and summary from its ``metrics.jsonl``, for a
finished job or one still running (a Monitor's ``out_dir``; the train command's ``--out``).

It reads the file as data (``history.py``: no code runs; a half-written last line is skipped
and counted), draws ``charts/training.png`` (``training_chart.py``; the timeline needs the
live pipeline and stays the monitor's) and prints: the steps logged, the loss (first, last,
best, and the moving average at the end), the best validation loss, throughput and step time
(medians, the first step left out: it holds the warm-up), MFU (an estimate where its peak was
assumed, naming it), the last learning rate and gradient norm, and the resumes, morphs and
restarts. The train command's ``summary.json`` adds the target step count and how the run
ended, when it is there and reads as expected.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..world import safe_json
from .display import mfu_text
from .history import (
    MORPH_EVENT,
    RESTART_EVENT,
    RESUME_EVENT,
    History,
    assumed_peak,
    marks,
    read_history,
    val_points,
)
from .sinks import METRICS
from .training_chart import ema, smoothing_span, training_chart

SUMMARY = "summary.json"  # the train command's (launch/train_worker.py)


def load_run(run_dir: str | Path) -> History:
    """The run's history, or an ``InputError`` saying which folder to give."""
    folder = Path(run_dir)
    if not folder.is_dir():
        raise InputError(f"varuna-fx report: {str(folder)!r} is not a folder: give the run's "
                         "folder (the train command's --out, runs/train by default, or a "
                         "Monitor's out_dir)")
    if not (folder / METRICS).is_file():
        raise InputError(f"varuna-fx report: {str(folder)!r} holds no {METRICS}: give the "
                         "folder a run writes it to (the train command's --out, or a "
                         "Monitor's out_dir); a run writes it from its first step on")
    return read_history(folder / METRICS)


def report(run_dir: str | Path, charts_dir: str | Path | None = None,
           charts: bool = True) -> tuple[list[str], Path | None]:
    """The summary's lines and the training chart written (None: not drawn -- asked not to,
    no step yet, or no matplotlib, which a line says)."""
    folder = Path(run_dir)
    history = load_run(folder)
    lines = summary_lines(history, _train_summary(folder))
    if not history.records or not charts:
        return lines, None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return lines + ["no chart: matplotlib is not installed (pip install "
                        "'varuna_fx[charts]')"], None
    out = Path(charts_dir) if charts_dir is not None else folder / "charts"
    out.mkdir(parents=True, exist_ok=True)
    first, last = history.records[0]["step"], history.records[-1]["step"]
    path = training_chart(history.records, out / "training.png", history.events,
                          marks(history.events), title=f"{folder.resolve().name}: steps "
                          f"{first}-{last}")
    return lines + [f"chart: {path}"], path


def _train_summary(folder: Path) -> dict[str, Any]:
    """The train command's summary.json when it reads as a JSON object, else {}."""
    try:
        summary = safe_json.loads((folder / SUMMARY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def _numbers(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(r["step"], float(r[key])) for r in records
            if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool)]


def _median(records: list[dict[str, Any]], key: str) -> float | None:
    values = [v for _, v in _numbers(records[1:] or records, key)]  # the first: warm-up
    return statistics.median(values) if values else None


def summary_lines(history: History, train: dict[str, Any] | None = None) -> list[str]:
    records, events = history.records, history.events
    train = train or {}
    lines = []
    if history.skipped:
        lines.append(f"{history.skipped} line(s) of {METRICS} not read (not a JSON record: a "
                     "last line still being written, or cut by a crash)")
    if not records:
        return lines + ["no step logged yet"]
    first, last = records[0]["step"], records[-1]["step"]
    target = train.get("steps")
    of = f" of {target}" if isinstance(target, int) and not isinstance(target, bool) else ""
    ended = ""
    if train.get("last_step") == last:  # summary.json is this run's end, not an older one's
        ended = "; preempted (resumable)" if train.get("preempted") is True else "; finished"
    times = _numbers(records, "time")
    wall = f" over {_duration(times[-1][1] - times[0][1])}" if len(times) > 1 else ""
    lines.append(f"steps {first}-{last}{of}: {len(records)} logged{wall}{ended}")
    loss = _numbers(records, "loss")
    if loss:
        best = min(loss, key=lambda p: p[1])
        smooth = ema([v for _, v in loss], smoothing_span(len(loss)))[-1]
        lines.append(f"loss: first {loss[0][1]:.4f}, last {loss[-1][1]:.4f}, best {best[1]:.4f}"
                     f" (step {best[0]}), moving average at the end {smooth:.4f}")
    val = val_points(records, events)
    if val:
        best = min(val, key=lambda p: p[1])
        lines.append(f"validation loss: best {best[1]:.4f} (step {best[0]}), last "
                     f"{val[-1][1]:.4f} (step {val[-1][0]}), {len(val)} evaluation(s)")
    lines.append(_speed(records))
    optimizer = [f"{name} {values[-1][1]:.4g} (step {values[-1][0]})" for name, values in
                 (("learning rate", _numbers(records, "lr")),
                  ("gradient norm", _numbers(records, "grad_norm"))) if values]
    if optimizer:
        lines.append("last " + ", ".join(optimizer))
    lines += _events(events)
    return lines


def _speed(records: list[dict[str, Any]]) -> str:
    parts = []
    tokens, samples = _median(records, "tokens_per_second"), \
        _median(records, "samples_per_second")
    if tokens is not None:
        parts.append(f"{tokens:,.0f} tokens/s")
    if samples is not None:
        parts.append(f"{samples:,.1f} samples/s")
    seconds, predicted = _median(records, "step_seconds"), \
        _median(records, "predicted_step_seconds")
    if seconds is not None:
        parts.append(f"{seconds * 1e3:.1f} ms/step" +
                     (f" (plan {predicted * 1e3:.1f} ms)" if predicted else ""))
    mfu = _median(records, "mfu")
    if mfu is not None:
        parts.append(mfu_text({"mfu": mfu, "mfu_assumed_peak": assumed_peak(records)}))
    return "throughput (medians, the first step left out): " + (" | ".join(parts) or "-")


def _events(events: list[dict[str, Any]]) -> list[str]:
    lines = []
    resumes = [e for e in events if e.get("event") == RESUME_EVENT]
    if resumes:
        lines.append(f"resumed {len(resumes)} time(s): " + "; ".join(
            m.label.replace("resumed", f"at step {m.step}", 1)
            for m in marks(resumes)))
    morphs = [e for e in events if e.get("event") == MORPH_EVENT]
    if morphs:
        lines.append(f"{len(morphs)} in-place morph(s): " + "; ".join(
            f"before step {e['step']} ({e.get('reason', '?')}) {e.get('old_layout')} -> "
            f"{e.get('new_layout')}" + (f" in {e['seconds']:.1f} s"
                                        if isinstance(e.get("seconds"), int | float) else "")
            for e in morphs))
    restarts = [e for e in events if e.get("event") == RESTART_EVENT]
    if restarts:
        lines.append(f"restarted {len(restarts)} time(s), from step(s) "
                     + ", ".join(str(e["step"]) for e in restarts))
    return lines


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


# -- the command (launch/cli.py adds it) ---------------------------------------------------------

def add_report_command(sub: Any) -> None:
    """``varuna-fx report`` on the CLI's subparsers."""
    parser = sub.add_parser(
        "report", help="draw a run's training chart and print its summary from metrics.jsonl",
        description="Read RUN_DIR/metrics.jsonl (a finished run's or a running one's), draw "
                    "RUN_DIR/charts/training.png (loss with its moving average and the "
                    "validation loss, learning rate and gradient norm, throughput and MFU, "
                    "step time against the plan; marks where the run resumed, changed layout "
                    "or morphed) and print a summary: steps, loss first/last/best, best "
                    "validation loss, throughput, resumes and morphs.")
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="the run's folder (the train command's --out; a Monitor's out_dir)")
    parser.add_argument("--charts-dir", default=None, metavar="DIR",
                        help="write training.png here instead of RUN_DIR/charts")
    parser.add_argument("--no-charts", action="store_true", help="print the summary only")
    parser.set_defaults(func=report_command)


def report_command(args: argparse.Namespace) -> int:
    lines, _ = report(args.run_dir, args.charts_dir, charts=not args.no_charts)
    print(f"{args.run_dir}:")
    for line in lines:
        print(f"  {line}")
    return 0
