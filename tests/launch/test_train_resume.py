"""``varuna-fx train`` relaunched on a run folder, in one process (issue 42, item 7): the
flags of the new launch win over what the checkpoint holds (the optimizer's hyperparameters,
as config.toml records them), a damaged newest checkpoint gives way to the newest intact one
(saying so), and a finished run relaunched with ``--export`` exports. And (item 8) the launch
that starts an in-place job again after state was lost says so everywhere, and in-place jobs
take an early first checkpoint."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from varuna_fx.errors import CheckpointError
from varuna_fx.monitor.sinks import METRICS, read_jsonl
from varuna_fx.train import worker as train_worker
from varuna_fx.train.config import TrainConfig
from varuna_fx.train.worker import CHECKPOINTS, Run, lr_factor
from varuna_fx.world.membership import Generation


def tiny(tmp_path: Path, **changes: Any) -> TrainConfig:
    return TrainConfig(**{"n_layer": 1, "n_embd": 16, "n_head": 2, "seq_len": 8,
                          "corpus_bytes": 4096, "steps": 10, "warmup_steps": 2,
                          "out": str(tmp_path / "run"), "live": False, "tensorboard": False,
                          "charts": False, **changes})


def saved_at(tmp_path: Path, *steps: int, **changes: Any) -> None:
    """A run folder holding checkpoints after ``steps`` (the optimizer untouched: what is
    checked here is what a resume takes from them)."""
    run = Run(tiny(tmp_path, **changes), None)
    pipe, opt, sched, loader, progress = run.build()
    for step in steps:
        with warnings.catch_warnings():  # (the scheduler steps without the optimizer here)
            warnings.simplefilter("ignore")
            while sched.last_epoch < step:
                sched.step()
        run.save(pipe, opt, sched, loader, step)
    pipe.close()



def test_a_resume_with_other_optimizer_flags_takes_the_flags(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Saved at lr 3e-3, resumed with --lr 1e-3 --weight-decay 0.05 --beta2 0.99: the groups
    and the scheduler run at the new values from the resumed step on (the old rate was kept
    while config.toml recorded the new one), and the console says what changed."""
    saved_at(tmp_path, 4)
    cfg = tiny(tmp_path, lr=1e-3, weight_decay=0.05, beta2=0.99)
    pipe, opt, sched, _, progress = Run(cfg, None).build()
    assert progress.step == 4 and sched.last_epoch == 4
    assert sched.base_lrs == [1e-3, 1e-3]
    expected = 1e-3 * lr_factor(cfg)(4)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([expected, expected])
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]  # decay on weights only
    assert all(g["betas"] == (0.9, 0.99) for g in opt.param_groups)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * lr_factor(cfg)(5))
    out = capsys.readouterr().out
    assert "lr 0.003 -> 0.001" in out and "weight_decay 0.1 -> 0.05" in out, out
    assert "beta2 0.95 -> 0.99" in out and "this launch's flags win" in out
    pipe.close()


def test_a_damaged_newest_checkpoint_resumes_from_the_newest_intact_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved_at(tmp_path, 3, 6)
    folder = tmp_path / "run" / CHECKPOINTS
    data = next((folder / "step00000006").glob("*.raw"))
    data.write_bytes(data.read_bytes()[:100])  # a disk that lost the end of the file
    pipe, _, sched, _, progress = Run(tiny(tmp_path), None).build()
    assert progress.step == 3 and sched.last_epoch == 3
    out = capsys.readouterr().out
    assert f"{folder / 'step00000006'} cannot be resumed" in out, out
    assert f"resumed from {folder / 'step00000003'} (step 3)" in out
    pipe.close()
    # none intact: the newest is named, with why, and no advice to change the configuration
    data = next((folder / "step00000003").glob("*.raw"))
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError) as caught:
        Run(tiny(tmp_path), None).build()
    text = str(caught.value)
    assert "step00000006" in text and "step00000003" in text and "none of the 2" in text, text


def test_a_finished_run_relaunched_with_export_exports(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], handlers: None) -> None:
    saved_at(tmp_path, 10)
    export = tmp_path / "hf"
    assert Run(tiny(tmp_path, export=str(export)), None).train() == 0
    out = capsys.readouterr().out
    assert "nothing to train" in out and f"exported the model to {export}" in out, out
    assert (export / "model.safetensors").is_file() or \
        any(export.glob("*.safetensors")), sorted(export.iterdir())


# -- an in-place job started again (issue 42, item 8) -----------------------------------------


def test_a_restart_is_a_start_generation_after_the_first() -> None:
    def gen(number: int, reason: str) -> Generation:
        return Generation(number, ("m",), ("m",), admitted=1, reason=reason)

    assert not gen(0, "start").restarted and gen(2, "start").restarted
    assert not gen(3, "join").restarted and not gen(1, "lost").restarted


def test_in_place_jobs_take_an_early_first_checkpoint_by_default() -> None:
    assert TrainConfig().first_checkpoint_step == 0
    assert TrainConfig(elastic=True, in_place=True).first_checkpoint_step == 10
    assert TrainConfig(elastic=True, in_place=True, checkpoint_every=5).first_checkpoint_step == 1
    assert TrainConfig(elastic=True, in_place=True, checkpoint_every=0,
                       steps=300).first_checkpoint_step == 30
    assert TrainConfig(elastic=True, in_place=True, first_checkpoint=0).first_checkpoint_step == 0
    assert TrainConfig(first_checkpoint=7).first_checkpoint_step == 7


def test_a_restarted_job_says_so_loudly_and_marks_the_steps_trained_again(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], handlers: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Five steps logged, then state lost before any checkpoint: the launch that starts the
    job again (its generation a restart) trains from step 0. It said "steps 1-3 done" as if
    nothing happened, and metrics.jsonl held both runs' steps; now the console (at the start
    and the end), summary.json and a "restart" event line say it, and readers of
    metrics.jsonl drop the superseded records. The early first checkpoint is taken too."""
    out = tmp_path / "run"
    out.mkdir()
    (out / METRICS).write_text("".join(
        json.dumps({"step": s, "loss": 9.0}) + "\n" for s in range(1, 6)))
    monkeypatch.setattr(train_worker, "in_place", lambda: True)
    monkeypatch.setattr(train_worker, "job_restarted", lambda: True)
    monkeypatch.setattr(train_worker, "membership",
                        lambda: SimpleNamespace(offer=lambda parts: None))
    cfg = tiny(tmp_path, steps=3, checkpoint_every=0, first_checkpoint=2)
    assert Run(cfg, None).train() == 0
    text = capsys.readouterr().out
    assert text.count("RESTARTED: the in-place job lost state with its only holders") == 2, text
    assert "continues from step 0: no checkpoint had been saved yet; steps 1-5, logged " \
        "before, are trained again" in text
    lines = [json.loads(line) for line in (out / METRICS).read_text().splitlines()]
    event = lines[5]
    assert (event["event"], event["step"], event["trained_again"]) == ("restart", 0, [1, 5])
    assert [r["step"] for r in lines[6:]] == [1, 2, 3]
    assert [r["step"] for r in read_jsonl(out / METRICS)] == [1, 2, 3]
    assert all(r["loss"] != 9.0 for r in read_jsonl(out / METRICS))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarted"]["trained_again"] == [1, 5]
    assert sorted(p.name for p in (out / CHECKPOINTS).iterdir()) == ["step00000002",
                                                                      "step00000003"]
