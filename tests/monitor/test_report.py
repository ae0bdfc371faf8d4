"""A run's metrics.jsonl read back (history.py), the training chart drawn from it
(training_chart.py) and ``varuna-fx report RUN_DIR`` (report.py), on files written here: the
superseded steps of a resume, a half-written last line, the marks, the panels a person reads
and the summary's lines. No pipeline is compiled."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from matplotlib.figure import Figure

import varuna_fx as vf
from varuna_fx.launch.cli import main
from varuna_fx.monitor.history import marks, read_history
from varuna_fx.monitor.report import report
from varuna_fx.monitor.training_chart import ema, training_chart


def record(step: int, loss: float, **extra: Any) -> dict[str, Any]:
    return {"step": step, "loss": loss, "step_seconds": 0.02, "loop_seconds": 0.025,
            "predicted_step_seconds": 0.01, "samples": 8, "samples_per_second": 320.0,
            "tokens_per_second": 5120.0, "mfu": 0.004, "mfu_assumed_peak": 1e11,
            "peak_memory": 1000, "bytes_sent": 0, "time": 1000.0 + step, **extra}


def write_run(folder: Path) -> Path:
    """Steps 1-12 (then killed), resumed from step 8 on another layout, a morph before step
    15, evaluations every 5 steps, and a last line half written."""
    folder.mkdir(parents=True, exist_ok=True)
    lines: list[dict[str, Any]] = []
    for s in range(1, 13):
        lines.append(record(s, 9.0 if s > 8 else 5.0 / s, lr=1e-3 * s, grad_norm=2.0 / s,
                            **({"layout": "P=2 D=1 b=2 m=4 (2 ranks)"} if s == 1 else {}),
                            **({"val_loss": 5.5 / s} if s % 5 == 0 else {})))
    lines.append({"event": "resume", "step": 9, "layout": "P=1 D=2 b=2 m=4 (2 ranks)",
                  "previous_layout": "P=2 D=1 b=2 m=4 (2 ranks)"})
    for s in range(9, 21):
        if s == 15:
            lines.append({"event": "morph", "step": 15, "seconds": 1.25, "reason": "notice",
                          "old_layout": "P=1 D=2 b=2 m=4 (2 ranks)",
                          "new_layout": "P=1 D=1 b=2 m=8 (1 ranks)", "left": ["m1"]})
        lines.append(record(s, 5.0 / s, lr=1e-3 * s, grad_norm=2.0 / s,
                            **({"layout": "P=1 D=2 b=2 m=4 (2 ranks)"} if s == 9 else {}),
                            **({"val_loss": 5.5 / s} if s % 5 == 0 else {})))
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (folder / "metrics.jsonl").write_text(text + '"not a record"\n{"step": 21, "loss": 0.2')
    return folder


def test_history_keeps_each_step_once_and_skips_what_is_not_a_record(tmp_path: Path) -> None:
    history = read_history(write_run(tmp_path) / "metrics.jsonl")
    assert [r["step"] for r in history.records] == list(range(1, 21))
    assert all(r["loss"] != 9.0 for r in history.records)  # the steps the resume trained again
    assert history.skipped == 2  # the half-written last line, the string
    assert [e["event"] for e in history.events] == ["resume", "morph"]
    assert history.layout == "P=1 D=1 b=2 m=8 (1 ranks)"  # the morph's, the last named
    # what a run resuming at step 10 keeps: the lines before it
    before = read_history(tmp_path / "metrics.jsonl", before_step=10)
    assert [r["step"] for r in before.records] == list(range(1, 10))
    assert before.records[-1]["loss"] == pytest.approx(5 / 9)
    # a restart event (an in-place job started again from step 3) drops the later steps at once
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('\n{"event": "restart", "step": 3}\n')
    assert [r["step"] for r in read_history(tmp_path / "metrics.jsonl").records] == [1, 2, 3]


def test_marks_say_where_a_run_resumed_changed_layout_or_morphed() -> None:
    found = marks([
        {"event": "resume", "step": 9, "layout": "P=1 D=2 b=2 m=4 (2 ranks)",
         "previous_layout": "P=2 D=1 b=2 m=4 (2 ranks)"},
        {"event": "morph", "step": 15, "reason": "notice", "old_layout": "P=1 D=2 b=2 m=4",
         "new_layout": "P=1 D=1 b=2 m=8"},
        {"event": "restart", "step": 20}, {"event": "resume", "step": 20, "layout": "x (1 ranks)",
                                           "previous_layout": "x (1 process)"},
        {"event": "eval", "step": 5, "val_loss": 1.0}])
    assert [(m.step, m.kind, m.label) for m in found] == [
        (9, "resume", "resumed on another layout, P=2 D=1 b=2 m=4 -> P=1 D=2 b=2 m=4"),
        (15, "morph", "morph (notice): P=1 D=2 b=2 m=4 -> P=1 D=1 b=2 m=8"),
        (20, "restart", "restarted; resumed")]  # one line, both said; same layout: no change


def test_the_moving_average_is_debiased_and_skips_gaps() -> None:
    assert ema([2.0, 2.0, None, 2.0], span=9) == pytest.approx([2.0, 2.0, None, 2.0])
    smooth = ema([1.0, 0.0], span=3)  # alpha 0.5: the mean of the two, not pulled towards 0
    assert smooth == pytest.approx([1.0, 1 / 3])


def drawn(monkeypatch: pytest.MonkeyPatch) -> list[Figure]:
    """The figures the charts save (to look inside them)."""
    figures: list[Figure] = []
    real = Figure.savefig

    def keep(self: Figure, *args: Any, **kw: Any) -> None:
        figures.append(self)
        real(self, *args, **kw)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figures


def labels(fig: Figure) -> list[str]:
    found = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().texts]
    return found + [t.get_text() for legend in fig.legends for t in legend.texts]


def test_the_training_chart_has_what_a_person_reads(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    figures = drawn(monkeypatch)
    history = read_history(write_run(tmp_path) / "metrics.jsonl")
    path = training_chart(history.records, tmp_path / "training.png", history.events,
                          marks(history.events))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    loss_ax = fig.axes[0]
    text = labels(fig)
    for wanted in ("loss (each step)", "validation loss", "learning rate",
                   "gradient norm (before clipping)", "tokens / s", "plan's prediction"):
        assert wanted in text, text
    assert any(t.startswith("loss, moving average over") for t in text)
    assert "1: before step 9, resumed on another layout, P=2 D=1 b=2 m=4 -> P=1 D=2 b=2 m=4" \
        in text and "2: before step 15, morph (notice): P=1 D=2 b=2 m=4 -> P=1 D=1 b=2 m=8" in text
    assert [line.get_xdata()[0] for line in loss_ax.get_lines()
            if line.get_linestyle() == "--"] == [8.5, 14.5]  # the marks, before their steps
    val = next(line for line in loss_ax.get_lines() if line.get_label() == "validation loss")
    assert list(val.get_xdata()) == [5, 10, 15, 20]
    every = fig.axes + [child for ax in fig.axes for child in ax.child_axes]
    mfu_axis = [ax.get_ylabel() for ax in every if "MFU" in ax.get_ylabel()]
    assert mfu_axis == ["MFU (%), an estimate:\nassumed peak 100 GFLOP/s/device"]
    # no lr / grad_norm / val_loss / marks / MFU recorded: three panels, no optimizer panel
    figures.clear()
    plain = [{k: v for k, v in r.items() if k not in ("lr", "grad_norm", "val_loss", "mfu")}
             for r in history.records]
    training_chart(plain, tmp_path / "plain.png")
    assert len(figures[0].axes) == 3 and "learning rate" not in labels(figures[0])


def test_report_prints_the_summary_and_draws_the_chart(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run")
    (run / "summary.json").write_text(json.dumps({"last_step": 20, "steps": 30,
                                                  "preempted": True}))
    lines, chart = report(run)
    assert chart == run / "charts" / "training.png" and chart.stat().st_size > 10_000
    text = "\n".join(lines)
    assert "2 line(s) of metrics.jsonl not read" in text
    assert "steps 1-20 of 30: 20 logged over 19 s; preempted (resumable)" in text
    assert "loss: first 5.0000, last 0.2500, best 0.2500 (step 20)" in text
    assert "validation loss: best 0.2750 (step 20), last 0.2750 (step 20), 4 evaluation(s)" \
        in text
    assert "5,120 tokens/s | 320.0 samples/s | 20.0 ms/step (plan 10.0 ms) | MFU ~0.4% " \
           "(est., peak 100 GFLOP/s assumed)" in text
    assert "last learning rate 0.02 (step 20), gradient norm 0.1 (step 20)" in text
    assert "resumed 1 time(s): at step 9 on another layout, P=2 D=1 b=2 m=4 -> P=1 D=2 b=2 " \
           "m=4" in text
    assert "1 in-place morph(s): before step 15 (notice) P=1 D=2 b=2 m=4 (2 ranks) -> P=1 D=1 " \
           "b=2 m=8 (1 ranks) in 1.2 s" in text
    # the command: the same lines; elsewhere with --charts-dir; none with --no-charts
    assert main(["report", str(run), "--charts-dir", str(tmp_path / "elsewhere")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{run}:\n") and "loss: first 5.0000" in out
    assert (tmp_path / "elsewhere" / "training.png").is_file()
    assert report(run, charts=False)[1] is None


def test_report_of_a_run_before_its_first_step_and_of_no_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "metrics.jsonl").write_text("")  # a run that has not logged a step yet
    assert report(tmp_path) == (["no step logged yet"], None)
    with pytest.raises(vf.InputError, match="is not a folder"):
        report(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(vf.InputError, match="holds no metrics.jsonl"):
        report(tmp_path / "empty")
    assert main(["report", str(tmp_path / "missing")]) == 1  # said in a line, no traceback
    assert "error: varuna-fx report:" in capsys.readouterr().err


def test_report_takes_a_files_values_as_data_of_any_type(tmp_path: Path) -> None:
    """Nothing read is trusted: fields of the wrong type are left out, never a crash."""
    odd = {"loss": "low", "mfu": 0.5, "mfu_assumed_peak": "1e11", "time": None, "layout": 5,
           "tokens_per_second": [1], "lr": True, "val_loss": {"a": 1}}
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, **odd}) + "\n" for s in (1, 2)) + json.dumps(
        {"event": "morph", "step": 2, "seconds": "long", "old_layout": None}) + "\n")
    (tmp_path / "summary.json").write_text('["not", "an", "object"]')
    lines, chart = report(tmp_path)
    assert chart is not None and "MFU 50.0%" in "\n".join(lines)  # no assumed peak: not "~"
    assert "loss:" not in "\n".join(lines) and "1 in-place morph(s)" in "\n".join(lines)
