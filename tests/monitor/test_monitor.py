"""vf.Monitor in one process: the JSONL records and their keys, plain lines off a terminal and
a live line on one, MFU as stated (an estimate against an assumed peak on a CPU), TensorBoard
when installed (and skipped cleanly when not), Weights & Biases (a fake module; wandb itself
when installed), the charts, a resumed run's records and its event, an in-place morph as an
event, and the refusals."""

from __future__ import annotations

import builtins
import io
import json
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.monitor import monitor as monitor_module
from varuna_fx.monitor.charts import simulated, timeline_chart
from varuna_fx.monitor.flops import step_flops
from varuna_fx.monitor.sinks import read_jsonl
from varuna_fx.morph.records import MorphRecord
from varuna_fx.train.config import TrainConfig
from varuna_fx.train.trainer import build_monitor

REQUIRED = {"step", "loss", "step_seconds", "predicted_step_seconds", "tokens_per_second", "mfu"}


@pytest.fixture(scope="module")
def pipe() -> vf.Pipeline:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
    return vf.compile(GPT(cfg), vf.Cluster(gpus=2, device="cpu"),
                      (torch.zeros(4, 8, dtype=torch.long),), loss_fn=lm_loss, stages=2,
                      micro_batch_size=2, schedule="1f1b")


def run(pipe: vf.Pipeline, monitor: vf.Monitor, steps: int) -> list[dict[str, Any]]:
    records = []
    for _ in range(steps):
        x = torch.randint(0, 64, (4, 8))
        loss = pipe.step(x, target=x)
        records.append(monitor.log(loss, lr=0.1))
    return records


def test_records_lines_and_charts(pipe: vf.Pipeline, tmp_path: Path) -> None:
    out = io.StringIO()
    monitor = vf.Monitor(pipe, tmp_path, total_steps=5, print_every=2, tensorboard=False,
                         console=Console(file=out, width=300), memory_every=2)
    records = run(pipe, monitor, 5)
    charts = monitor.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == records and [r["step"] for r in lines] == [1, 2, 3, 4, 5]
    for r in lines:
        assert REQUIRED <= set(r) and r["lr"] == 0.1
        assert r["tokens_per_second"] == pytest.approx(32 / (r["loop_seconds"] or
                                                            r["step_seconds"]))
    r = lines[-1]
    peak = 2 * 5e10  # the assumed CPU peak, stated in the header
    assert r["mfu"] == pytest.approx(step_flops(pipe.plan, 4) / (r["loop_seconds"] * peak))
    assert r["predicted_step_seconds"] == pipe.plan.predicted_step_time
    assert lines[1]["peak_memory_per_rank"] and "peak_memory_per_rank" not in lines[0]
    text = out.getvalue()  # not a terminal: plain lines at steps 2, 4 and the last
    assert "assumed" in text and "MFU = the plan's FLOPs per step" in text
    steps = [line.split(" |")[0] for line in text.splitlines() if line.startswith("step ")]
    assert steps == ["step 2/5", "step 4/5", "step 5/5"]
    assert "\x1b[" not in text  # no cursor movement or colour codes in a log file
    assert sorted(p.name for p in charts) == ["timeline.png", "training.png"]
    for path in charts:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_a_live_line_on_a_terminal(pipe: vf.Pipeline, tmp_path: Path) -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200)
    with vf.Monitor(pipe, tmp_path, total_steps=3, tensorboard=False, console=console,
                    charts=False) as m:
        run(pipe, m, 3)
    assert "step 1/3" in out.getvalue() and "━" in out.getvalue()  # the bar


def test_tensorboard_when_installed_and_skipped_when_not(pipe: vf.Pipeline, tmp_path: Path,
                                                         monkeypatch: Any) -> None:
    real_import = builtins.__import__

    def without_tensorboard(name: str, *args: Any, **kw: Any) -> Any:
        if name == "torch.utils.tensorboard":
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kw)

    pytest.importorskip("tensorboard")
    quiet = Console(file=io.StringIO())
    with vf.Monitor(pipe, tmp_path / "on", live=False, console=quiet, charts=False) as m:
        run(pipe, m, 1)
    assert list((tmp_path / "on" / "tensorboard").iterdir())
    monkeypatch.setattr(builtins, "__import__", without_tensorboard)
    with vf.Monitor(pipe, tmp_path / "off", live=False, console=quiet, charts=False) as m:
        run(pipe, m, 1)
    assert not (tmp_path / "off" / "tensorboard").exists()
    with pytest.raises(vf.InputError, match=r"varuna_fx\[tensorboard\]"):
        vf.Monitor(pipe, tmp_path / "required", tensorboard=True)


def test_a_resumed_run_keeps_the_earlier_records_for_its_charts(pipe: vf.Pipeline,
                                                                tmp_path: Path) -> None:
    quiet = Console(file=io.StringIO())
    with vf.Monitor(pipe, tmp_path, tensorboard=False, console=quiet, charts=False) as m:
        run(pipe, m, 4)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": [cut by a cra')  # a line a kill left half-written
    resumed = vf.Monitor(pipe, tmp_path, start_step=2, tensorboard=False, console=quiet,
                         charts=False)
    assert [r["step"] for r in resumed.records] == [1, 2]  # 3 and 4 are repeated after it
    run(pipe, resumed, 1)
    assert resumed.records[-1]["step"] == 3
    resumed.close()


def test_refusals(pipe: vf.Pipeline, tmp_path: Path) -> None:
    with pytest.raises(vf.InputError, match="print_every"):
        vf.Monitor(pipe, tmp_path, print_every=0)
    monitor = vf.Monitor(pipe, tmp_path, tensorboard=False, console=Console(file=io.StringIO()),
                         charts=False)
    run(pipe, monitor, 1)
    with pytest.raises(vf.InputError, match="no pipe.step since the last log"):
        monitor.log(1.0)
    monitor.close()


class Morphing:
    """The pipeline as an in-place job shows it: ``morphs`` grows when a step morphed."""

    def __init__(self, pipe: vf.Pipeline) -> None:
        self._pipe, self.morphs = pipe, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)


def test_a_morph_is_an_event_and_the_stalled_step_is_rated_by_its_own_time(
        pipe: vf.Pipeline, tmp_path: Path) -> None:
    out = io.StringIO()
    morphing = Morphing(pipe)
    with vf.Monitor(morphing, tmp_path, tensorboard=False, console=Console(file=out, width=400),
                    print_every=1, charts=False) as m:
        run(morphing, m, 2)
        time.sleep(0.5)  # the morph's stall, between the two logs
        morphing.morphs.append(MorphRecord(
            1, "notice", time.time(), "P=2 D=1 b=2 m=2 (2 ranks)", "P=1 D=1 b=2 m=2 (1 ranks)",
            phases={"agree": 0.25, "transfer": 0.125, "first_step": 0.5}, bytes_moved=2048,
            left=("m1",)))
        (stalled,) = run(morphing, m, 1)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("event", r["step"]) for r in lines] == [1, 2, "morph", 3]
    event = lines[2]
    assert (event["step"], event["reason"], event["left"], event["bytes_moved"]) == \
        (3, "notice", ["m1"], 2048)
    assert event["seconds"] == 0.375 and event["new_layout"].startswith("P=1")
    # the loop's time since step 2 holds the stall: step 3 is rated over pipe.step's own time
    assert stalled["loop_seconds"] is None
    assert stalled["samples_per_second"] == pytest.approx(4 / stalled["step_seconds"])
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert "in-place morph before step 3 (notice: m1 left): P=2 D=1 b=2 m=2 (2 ranks) -> " \
           "P=1 D=1 b=2 m=2 (1 ranks) in 0.38 s (agree 0.25, transfer 0.12, first step 0.50)" \
           ", 2.0 KiB moved" in out.getvalue()


def test_mfu_on_a_cpu_is_an_estimate_naming_the_assumed_peak(pipe: vf.Pipeline,
                                                             tmp_path: Path) -> None:
    out = io.StringIO()
    with vf.Monitor(pipe, tmp_path / "cpu", tensorboard=False, print_every=1, charts=False,
                    console=Console(file=out, width=400)) as m:
        (assumed,) = run(pipe, m, 1)
    assert assumed["mfu_assumed_peak"] == 2 * 5e10
    assert "MFU ~" in out.getvalue() and "(est., peak 100 GFLOP/s assumed)" \
        in out.getvalue() and "an estimate (shown as MFU ~x%)" in out.getvalue()
    out = io.StringIO()  # a peak the user gives is not an estimate
    with vf.Monitor(pipe, tmp_path / "given", tensorboard=False, print_every=1, charts=False,
                    console=Console(file=out, width=400), peak_flops=1e12) as m:
        (given,) = run(pipe, m, 1)
    assert "mfu_assumed_peak" not in given and "estimate" not in out.getvalue()
    assert f"MFU {given['mfu']:.1%} |" in out.getvalue()


def test_a_resume_is_an_event_naming_its_layout_and_the_charts_mark_it(
        pipe: vf.Pipeline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    quiet = Console(file=io.StringIO())
    with vf.Monitor(pipe, tmp_path, tensorboard=False, console=quiet, charts=False) as m:
        first = run(pipe, m, 3)
    layout = "P=2 D=1 b=2 m=2 (1 process)"
    assert first[0]["layout"] == layout and all("layout" not in r for r in first[1:])
    resumed = vf.Monitor(pipe, tmp_path, start_step=2, tensorboard=False, console=quiet)
    run(pipe, resumed, 2)
    drew = {}
    monkeypatch.setattr(monitor_module, "training_chart",
                        lambda records, path, events, marks: drew.update(
                            steps=[r["step"] for r in records], marks=marks) or path)
    resumed.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("event", r["step"]) for r in lines] == [1, 2, 3, "resume", 3, 4]
    assert lines[3] == {"event": "resume", "step": 3, "layout": layout,
                        "previous_layout": layout}
    assert lines[4]["layout"] == layout  # each launch's first record
    assert drew["steps"] == [1, 2, 3, 4]  # the step trained again is drawn once, the new one
    assert [(k.step, k.label) for k in drew["marks"]] == [(3, "resumed")]


def test_the_timelines_panels_share_one_time_axis(pipe: vf.Pipeline, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.figure import Figure

    figures: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **kw: figures.append(self))
    x = torch.randint(0, 64, (4, 8))
    pipe.step(x, target=x)
    rows = [(f"stage {s}", [a for a in pipe.last_step.timeline if a.stage == s]) for s in (0, 1)]
    timeline_chart(pipe.plan, rows, tmp_path / "timeline.png")
    top, bottom = figures[0].axes[:2]
    assert top.get_shared_x_axes().joined(top, bottom)
    measured = max(a.end for _, row in rows for a in row)
    assert top.get_xlim() == bottom.get_xlim() == \
        (0, max(measured, simulated(pipe.plan).step_time))
    assert "(ms)" in top.get_xlabel() and "(ms)" in bottom.get_xlabel()


class FakeRun:
    def __init__(self, **kw: Any) -> None:
        self.init, self.logged, self.finished = kw, [], False

    def log(self, data: dict[str, Any], step: int) -> None:
        self.logged.append((step, data))

    def finish(self) -> None:
        self.finished = True


def fake_wandb(monkeypatch: pytest.MonkeyPatch, fail: Exception | None = None) -> list[FakeRun]:
    """A ``wandb`` module the sink imports: its runs are kept (wandb itself need not be
    installed: CI has no wandb)."""
    runs: list[FakeRun] = []

    def init(**kw: Any) -> FakeRun:
        if fail is not None:
            raise fail
        runs.append(FakeRun(**kw))
        return runs[-1]

    module = types.ModuleType("wandb")
    module.init = init  # type: ignore[attr-defined]
    module.Settings = lambda **kw: ("Settings", kw)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return runs


def test_the_wandb_sink_logs_each_steps_numbers_offline_by_default(
        pipe: vf.Pipeline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = fake_wandb(monkeypatch)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    out = io.StringIO()
    morphing = Morphing(pipe)
    with vf.Monitor(morphing, tmp_path, tensorboard=False, wandb=True, memory_every=2,
                    charts=False, console=Console(file=out, width=400)) as m:
        records = run(morphing, m, 2)
        morphing.morphs.append(MorphRecord(1, "notice", time.time(), "a", "b",
                                           phases={"agree": 0.25}, bytes_moved=8))
        records += run(morphing, m, 1)
    (wb,) = runs
    assert wb.init["mode"] == "offline" and wb.init["dir"] == str(tmp_path)
    assert wb.init["project"] == "varuna-fx" and wb.init["config"]["stages"] == 2
    assert wb.init["settings"] == ("Settings", {"quiet": True, "console": "off"})
    assert "and W&B" in out.getvalue() and wb.finished
    steps = [step for step, _ in wb.logged]
    assert steps == [1, 2, 3, 3]  # the morph's numbers at the step it came before
    first = wb.logged[0][1]
    assert first["loss"] == records[0]["loss"] and first["lr"] == 0.1
    # numbers only: no layout (a string), per-rank lists, step or time, nor the assumed peak
    assert not {"layout", "step", "time", "mfu_assumed_peak"} & set(first)
    assert "peak_memory_per_rank" in records[1] and "peak_memory_per_rank" not in wb.logged[1][1]
    assert wb.logged[2][1] == {"morph/seconds": 0.25, "morph/bytes_moved": 8,
                               "morph/agree_seconds": 0.25}
    # the user's settings go to wandb.init; WANDB_MODE set: the sink does not choose a mode
    monkeypatch.setenv("WANDB_MODE", "disabled")
    with vf.Monitor(pipe, tmp_path / "mine", tensorboard=False, charts=False, console=Console(
            file=io.StringIO()), wandb={"project": "p", "config": {"lr": 1}}) as m:
        run(pipe, m, 1)
    assert "mode" not in runs[1].init and runs[1].init["project"] == "p"
    assert runs[1].init["config"]["lr"] == 1 and runs[1].init["config"]["stages"] == 2


def test_the_train_commands_wandb_key_reaches_the_monitor(
        pipe: vf.Pipeline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = fake_wandb(monkeypatch)
    for wandb in (False, True):
        cfg = TrainConfig(out=str(tmp_path / str(wandb)), wandb=wandb, live=False,
                          tensorboard=False, charts=False)
        with build_monitor(pipe, cfg, start_step=0) as m:
            run(pipe, m, 1)
    (wb,) = runs  # only where the key is true
    assert wb.init["dir"] == str(tmp_path / "True") and wb.finished


def test_wandb_refusals(pipe: vf.Pipeline, tmp_path: Path,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(vf.InputError, match="wandb='yes'"):
        vf.Monitor(pipe, tmp_path, wandb="yes")
    fake_wandb(monkeypatch, fail=RuntimeError("api_key not configured (no-tty)"))
    with pytest.raises(vf.InputError, match="api_key not configured.*WANDB_MODE=offline"):
        vf.Monitor(pipe, tmp_path, wandb={"mode": "online"}, tensorboard=False)
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: import fails
    with pytest.raises(vf.InputError, match=r"pip install 'varuna_fx\[wandb\]'"):
        vf.Monitor(pipe, tmp_path, wandb=True, tensorboard=False)


@pytest.mark.slow  # wandb.init starts W&B's service process
def test_the_wandb_sink_with_wandb_itself_offline(pipe: vf.Pipeline, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline by the sink's default
    with vf.Monitor(pipe, tmp_path, tensorboard=False, wandb={"name": "t"}, charts=False,
                    console=Console(file=io.StringIO())) as m:
        records = run(pipe, m, 3)
    (folder,) = (tmp_path / "wandb").glob("offline-run-*")  # (uploaded later by wandb sync)
    (log,) = folder.glob("run-*.wandb")  # W&B's record log: each value held as JSON text
    held = log.read_bytes()
    assert all(json.dumps(r["loss"]).encode() in held for r in records)
