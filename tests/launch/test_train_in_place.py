"""``varuna-fx train --elastic --in-place`` as a user runs it, on 2 gloo processes of this
machine: one process is sent a spot notice (SIGTERM) or killed (SIGKILL) after step 3 is
logged, and the survivor trains on. Every step's loss equals an uninterrupted one-process run's
(every layout equals eager; the losses are fp32, so up to summation order), each step is logged
once with the uninterrupted run's learning rate, the morph is an event of ``metrics.jsonl``, a
console line and an entry of ``summary.json``, and the step after it is rated over its own
time, not the stall.

* notice, P=2 -> P=1: the leaver hands its stage over and exits; the run stops at ``stop_at``,
  and the checkpoint saved there (on the new layout) is resumed by the plain command to the end;
* kill, D=2 -> D=1: the survivor re-runs the step in flight; the launcher starts the killed
  process again, which joins the running job (the survivor is paused meanwhile, so that it
  joins before the end) and takes its step count, schedule and data position from the others.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from support.in_place import Lines, launcher_env, worker_pid
from support.ranks import free_port

STEPS = 40
TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "16",
        "--global-batch-size", "8", "--micro-batch-size", "2", "--corpus-bytes", "20000",
        "--steps", str(STEPS), "--checkpoint-every", "8", "--tensorboard", "false",
        "--live", "false", "--charts", "false", "--print-every", "1"]


def train(out: Path, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "varuna_fx.launch.cli", "train", *TINY, "--out", str(out),
         *flags], env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)


def in_place(out: Path, port: int, *flags: str) -> subprocess.Popen[str]:
    return train(out, "--elastic", "--in-place", "--nproc", "2", "--rdzv-endpoint",
                 f"127.0.0.1:{port}", *flags)


def metrics(out: Path) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """The step records (each step logged exactly once) and the event lines."""
    steps: dict[int, dict[str, Any]] = {}
    events = []
    for record in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()):
        if "event" in record:
            events.append(record)
        else:
            assert record["step"] not in steps, f"step {record['step']} logged twice"
            steps[record["step"]] = record
    return steps, events


def check_against(reference: dict[int, dict[str, Any]], steps: dict[int, dict[str, Any]],
                  first: int, last: int) -> None:
    """Steps first..last, each once, with the reference's losses and learning rates."""
    assert sorted(steps) == list(range(first, last + 1)), sorted(steps)
    torch.testing.assert_close(torch.tensor([steps[s]["loss"] for s in sorted(steps)]),
                               torch.tensor([reference[s]["loss"] for s in sorted(steps)]),
                               rtol=1e-5, atol=1e-6)
    assert [steps[s]["lr"] for s in sorted(steps)] == [reference[s]["lr"] for s in sorted(steps)]


def finish(lines: Lines) -> str:
    code = lines.finish()
    assert code == 0, lines.text()
    return "".join(lines.seen)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """The uninterrupted run: one process."""
    out = tmp_path_factory.mktemp("reference")
    finish(Lines(train(out, "--nproc", "1")))
    steps, events = metrics(out)
    assert not events and sorted(steps) == list(range(1, STEPS + 1))
    return steps


@pytest.mark.slow
@pytest.mark.distributed
def test_a_notice_repartitions_and_the_checkpoint_after_it_resumes(
        tmp_path: Path, reference: dict[int, dict[str, Any]]) -> None:
    out, stop = tmp_path / "run", STEPS - 4
    lines = Lines(in_place(out, free_port(), "--stages", "2", "--stop-at", str(stop)))
    lines.wait_for(r"^step 3/")
    # a notice to one process (to the command, it would be one to every process of the machine)
    os.kill(worker_pid(lines.proc, 1), signal.SIGTERM)
    text = finish(lines)
    assert "left the job after handing over its state" in text
    steps, events = metrics(out)
    check_against(reference, steps, 1, stop)
    (event,) = events
    assert event["reason"] == "notice" and len(event["left"]) == 1
    assert event["old_layout"].startswith("P=2 D=1") and event["new_layout"].startswith("P=1 D=1")
    assert 4 <= event["step"] <= stop and event["bytes_moved"] > 0
    assert set(event["phases"]) >= {"agree", "transfer", "adopt", "first_step"}
    assert steps[event["step"]]["loop_seconds"] is None  # rated over the step, not the stall
    assert f"in-place morph before step {event['step']} (notice: " in text
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["last_step"], summary["preempted"]) == (stop, False)
    assert [m["reason"] for m in summary["morphs"]] == ["notice"]
    assert Path(summary["checkpoint"]).name == f"step{stop:08d}"
    # the checkpoint the new layout saved: the plain command resumes it to the end
    text = finish(Lines(train(out, "--nproc", "1")))
    assert f"(step {stop})" in text
    check_against(reference, metrics(out)[0], 1, STEPS)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_killed_process_loses_only_its_step_and_joins_again(
        tmp_path: Path, reference: dict[int, dict[str, Any]]) -> None:
    out, port = tmp_path / "run", free_port()
    lines = Lines(in_place(out, port, "--stages", "1", "--shard-optimizer", "false"))
    lines.wait_for(r"^step 3/")
    survivor = worker_pid(lines.proc, 0)
    os.kill(worker_pid(lines.proc, 1), signal.SIGKILL)
    lines.wait_for(r"in-place morph before step \d+ \(lost")
    # the launcher starts the killed process again; hold the survivor until it registers, so
    # that it joins before the run ends (whatever the machine's speed)
    os.kill(survivor, signal.SIGSTOP)
    try:
        store = dist.PrefixStore("varuna_fx/varuna-fx/", dist.TCPStore(
            "127.0.0.1", port, None, False, timedelta(seconds=60)))
        deadline = time.monotonic() + 120
        while int(store.add("joins", 0)) < 3:
            assert time.monotonic() < deadline, lines.text()
            time.sleep(0.1)
    finally:
        os.kill(survivor, signal.SIGCONT)
    text = finish(lines)
    steps, events = metrics(out)
    check_against(reference, steps, 1, STEPS)
    lost, join = events
    assert (lost["reason"], len(lost["lost"])) == ("lost", 1) and lost["bytes_moved"] == 0
    assert lost["old_layout"].startswith("P=1 D=2") and lost["new_layout"].startswith("P=1 D=1")
    assert join["reason"] == "join" and join["new_layout"].startswith("P=1 D=2")
    assert lost["step"] < join["step"] <= STEPS
    assert f"joined the running job at step {join['step'] - 1}" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["last_step"] == STEPS
    assert [m["reason"] for m in summary["morphs"]] == ["lost", "join"]
