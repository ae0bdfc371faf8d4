"""Quiet, honest output of the commands: one error printed once, torchrun's OMP_NUM_THREADS
banner replaced by one line, a top-level --help without notes for the code's readers."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from varuna_fx.errors import InputError
from varuna_fx.launch import torchrun
from varuna_fx.launch.cli import build_parser
from varuna_fx.launch.train import _print_rank_errors
from varuna_fx.train import worker
from varuna_fx.train.config import TrainConfig


def test_an_error_every_rank_has_is_printed_once_and_one_only_rank_1_had_is_printed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = TrainConfig(out=str(tmp_path / "run"))
    since = time.time() - 1
    for number in (0, 1, 2):  # every rank fails the same way
        monkeypatch.setattr(worker, "this_rank", lambda n=number: n)
        worker.report_error(cfg, InputError("the same refusal"))
    printed = capsys.readouterr().err
    assert printed.count("the same refusal") == 1 and "rank 1" not in printed  # rank 0 only
    assert _print_rank_errors(cfg, since) and capsys.readouterr().err == ""  # said already
    monkeypatch.setattr(worker, "this_rank", lambda: 1)
    (tmp_path / "run" / "errors" / "rank0.txt").unlink()
    worker.report_error(cfg, InputError("only rank 1's"))
    assert capsys.readouterr().err == ""
    assert _print_rank_errors(cfg, since)
    err = capsys.readouterr().err
    assert err.count("only rank 1's") == 1 and "error (rank 1)" in err
    assert not _print_rank_errors(cfg, time.time() + 10)  # an earlier launch's: not this one's


def test_omp_num_threads_is_set_for_the_ranks_in_one_line_when_unset(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert torchrun.thread_setting(2) == {"OMP_NUM_THREADS": "1"}
    assert capsys.readouterr().err.count("OMP_NUM_THREADS=1") == 1
    assert torchrun.thread_setting(1) == {}
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert torchrun.thread_setting(2) == {} and capsys.readouterr().err == ""


def test_top_level_help_is_for_users() -> None:
    text = build_parser().format_help()
    assert "launch/train.py" not in text and "``" not in text and "main()" not in text
