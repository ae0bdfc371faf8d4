"""``varuna-fx train`` as a user runs it: the command launches its own ranks (torchrun), writes
the metrics, the charts and checkpoints; SIGTERM to the command saves and exits 143, and the
same command resumes -- on the same layout with the uninterrupted run's losses bit for bit, on
another with its samples and learning rates (losses up to summation order).

One run is stopped by SIGTERM after its second step (at step s, whatever the machine's speed
makes it), one runs uninterrupted to s + 2; the stopped one's folder is resumed to s + 2 on 2
processes (P=2, as before) and on 1 (P=1)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from varuna_fx.examples import GPT, GPTConfig
from varuna_fx.train.config import TrainConfig
from varuna_fx.train.data import open_data
from varuna_fx.train.model import next_token_loss

# a tiny GPT on 200 kB of the built-in corpus: the run is 200 steps long (its LR schedule), the
# launches stop it early with SIGTERM or stop_at
TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "16",
        "--global-batch-size", "8", "--corpus-bytes", "200000", "--steps", "200",
        "--checkpoint-every", "0", "--log-samples", "--tensorboard", "false",
        "--print-every", "1", "--schedule", "1f1b"]
TWO = ["--nproc", "2", "--stages", "2"]
ONE = ["--nproc", "1", "--stages", "1"]
TIMEOUT = 240.0


def command(out: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "varuna_fx.launch.cli", "train", *TINY, "--out", str(out),
            *flags]


def env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")


def train(out: Path, *flags: str, code: int = 0) -> str:
    done = subprocess.run(command(out, *flags), env=env(), capture_output=True, text=True,
                          timeout=TIMEOUT)
    log = done.stdout + done.stderr
    assert done.returncode == code, log[-4000:]
    return log


def records(out: Path, name: str = "metrics.jsonl") -> dict[int, dict[str, Any]]:
    """Each step's record, the last one written for it (a resumed run appends)."""
    lines = (out / name).read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def terminated_after_two_steps(out: Path) -> int:
    """Run the command, SIGTERM it once two steps are logged; the step it saved."""
    with open(out.parent / "stopped.log", "w") as log:
        proc = subprocess.Popen(command(out, *TWO), env=env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        samples, deadline = out / "samples.jsonl", time.monotonic() + TIMEOUT
        while not (samples.exists() and len(samples.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, \
                (out.parent / "stopped.log").read_text()[-4000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT) == 143, (out.parent / "stopped.log").read_text()[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["preempted"] and summary["last_step"] < 200
    assert Path(summary["checkpoint"]).name == f"step{summary['last_step']:08d}"
    return summary["last_step"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("train")
    stopped = root / "stopped"
    s = terminated_after_two_steps(stopped)
    whole = root / "whole"
    log = train(whole, *TWO, "--stop-at", str(s + 2))
    return {"root": root, "stopped": stopped, "s": s, "whole": whole, "log": log}


@pytest.mark.slow
@pytest.mark.distributed
def test_the_command_trains_on_two_processes_and_writes_metrics_charts_checkpoints(
        runs: dict[str, Any]) -> None:
    whole, s = runs["whole"], runs["s"]
    metrics = records(whole)
    assert sorted(metrics) == list(range(1, s + 3))
    need = {"step", "loss", "step_seconds", "predicted_step_seconds", "tokens_per_second",
            "mfu", "lr", "grad_norm", "samples"}
    assert all(need <= set(r) and r["samples"] == 8 for r in metrics.values())
    assert metrics[s + 2]["loss"] < metrics[1]["loss"]
    assert (whole / "charts" / "training.png").stat().st_size > 10_000
    assert (whole / "charts" / "timeline.png").stat().st_size > 10_000
    assert [p.name for p in (whole / "checkpoints").iterdir()] == [f"step{s + 2:08d}"]
    summary = json.loads((whole / "summary.json").read_text())
    assert (summary["first_step"], summary["last_step"], summary["preempted"]) == (0, s + 2,
                                                                                  False)
    assert "stages = 2  #" in (whole / "config.toml").read_text()
    assert "plan: P=2 x D=1" in runs["log"] and f"stopped at step {s + 2}" in runs["log"]


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_then_the_same_command_resumes_on_the_same_and_another_layout(
        runs: dict[str, Any]) -> None:
    root, s = runs["root"], runs["s"]
    whole = records(runs["whole"])
    ids = records(runs["whole"], "samples.jsonl")
    resumed = {}
    for name, layout in (("same", TWO), ("one", ONE)):
        out = root / name
        shutil.copytree(runs["stopped"], out)
        log = train(out, *layout, "--stop-at", str(s + 2))
        assert f"(step {s})" in log  # resumed from the SIGTERM's checkpoint
        resumed[name] = records(out)
        assert sorted(resumed[name]) == list(range(1, s + 3))
        assert records(out, "samples.jsonl") == ids  # the same samples, step by step
        assert [resumed[name][k]["lr"] for k in whole] == [whole[k]["lr"] for k in whole]
    after = range(s + 1, s + 3)
    # the same layout: the uninterrupted run's losses exactly
    assert [resumed["same"][k]["loss"] for k in after] == [whole[k]["loss"] for k in after]
    torch.testing.assert_close(torch.tensor([resumed["one"][k]["loss"] for k in after]),
                               torch.tensor([whole[k]["loss"] for k in after]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.distributed
def test_export_at_the_end_and_init_from_start_from_its_weights(tmp_path: Path) -> None:
    """The built-in GPT trained on 2 processes and exported at the end (safetensors, each rank
    its stage); a new run started from the export (same seed: the same first batch) gets at
    its first step the loss an eager GPT holding the exported tensors gives on that batch.
    (That from_pretrained opens an export of a Hugging Face model is tests/checkpoint's.)"""
    small = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "16",
             "--global-batch-size", "8", "--corpus-bytes", "100000", "--steps", "6",
             "--charts", "false", "--tensorboard", "false", "--log-samples"]

    def run(out: Path, *more: str) -> dict[int, dict[str, Any]]:
        done = subprocess.run([sys.executable, "-m", "varuna_fx.launch.cli", "train", *small,
                               "--out", str(out), *more], env=env(), capture_output=True,
                              text=True, timeout=TIMEOUT)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        return records(out)

    export = tmp_path / "export"
    trained = run(tmp_path / "a", "--nproc", "2", "--stages", "2", "--export", str(export))
    assert len(list(export.glob("*.safetensors"))) == 2  # a shard per stage
    started = run(tmp_path / "b", "--nproc", "1", "--init-from", str(export), "--stop-at", "1")

    model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32))
    weights = {k: v for shard in export.glob("*.safetensors") for k, v in load_file(shard).items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert set(missing) <= {"lm_head.weight", "wte.weight"} and not unexpected  # tied: once
    ids = records(tmp_path / "b", "samples.jsonl")[1]["ids"]
    data = open_data(TrainConfig(seq_len=16, corpus_bytes=100000)).dataset
    x, y = (torch.stack(t) for t in zip(*(data[i] for i in ids)))
    with torch.no_grad():
        eager = float(next_token_loss(model(x), y))
    assert math.isclose(started[1]["loss"], eager, rel_tol=1e-5)
    assert started[1]["loss"] < trained[1]["loss"] - 0.2  # trained weights, not fresh ones
