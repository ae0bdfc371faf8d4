"""Checkpoints across layouts and processes: saved at P=2 in one process or on 2 ranks, resumed
at (P, D) = (1, 2), (2, 1), (2, 2) on gloo ranks and at P=3 in one process, each equal to the
uninterrupted float64 run; SIGTERM to one rank under torchrun stops every rank at one step with
a loadable checkpoint."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import varuna_fx as vf
from support.dist import SCRIPTS, run_jobs
from support.payloads import Stealthy
from support.training import (
    CKPT_SPLIT,
    CKPT_STEPS,
    CKPT_TOL,
    ckpt_eager_training,
    ckpt_model,
    ckpt_optimizer,
    ckpt_tokens,
)
from varuna_fx.examples import lm_loss

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SCRIPT = "checkpoint_jobs.py"


def run(out: Path, nproc: int, jobs: list[dict[str, Any]]) -> dict[str, list[dict]]:
    return run_jobs(out, nproc, jobs, script=SCRIPT, timeout=240)


def one_process(stages: int, path: Path | None, steps: range,
                micro: int = 2) -> tuple[vf.Pipeline, torch.optim.Optimizer]:
    pipe = vf.compile(ckpt_model(seed=7 if path else 0), example_inputs=(ckpt_tokens()[0, :, :-1],),
                      loss_fn=lm_loss, stages=stages, micro_batch_size=micro)
    opt = ckpt_optimizer(pipe.parameters())
    if path is not None:
        assert pipe.load_checkpoint(str(path), optimizer=opt) == {"step": steps.start}
    data = ckpt_tokens()
    for step in steps:
        pipe.zero_grad()
        pipe.step(data[step, :, :-1], target=data[step, :, 1:])
        opt.step()
    return pipe, opt


def check(state: dict[str, torch.Tensor], eager: dict[str, torch.Tensor], where: str) -> None:
    for name, value in state.items():
        torch.testing.assert_close(value, eager[name], **CKPT_TOL,
                                   msg=lambda m, n=name: f"{n} ({where}): {m}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("dist_ckpt")
    local = out / "local"
    pipe, opt = one_process(2, None, range(CKPT_SPLIT))
    pipe.save_checkpoint(str(local), optimizer=opt, extra={"step": CKPT_SPLIT})
    crafted = out / "crafted"  # metadata that would run code, then return the genuine one
    shutil.copytree(local, crafted)
    genuine = pickle.loads((crafted / ".metadata").read_bytes())
    (crafted / ".metadata").write_bytes(pickle.dumps(Stealthy(out / "ran", genuine)))
    two = run(out, 2, [
        {"name": "crafted", "kind": "resume", "P": 2, "D": 1, "path": str(crafted)},
        # async: the next step runs while the shards are written (the SIGTERM test below
        # covers synchronous saves on ranks)
        {"name": "save", "kind": "save", "P": 2, "D": 1, "async": True,
         "path": str(out / "dist")},
        {"name": "resume_1x2", "kind": "resume", "P": 1, "D": 2, "path": str(local)},
        {"name": "resume_2x1", "kind": "resume", "P": 2, "D": 1, "micro": 4,
         "schedule": "1f1b", "path": str(local)},
        {"name": "paths", "kind": "paths", "P": 2, "D": 1, "path": str(out / "own" / "ck")},
        {"name": "forgot", "kind": "forgot", "P": 2, "D": 1},  # last: its pipe stays open
    ])
    four = run(out, 4, [
        # built under vf.skip_init: the replicas broadcast garbage, then the load fills it
        {"name": "resume_2x2", "kind": "resume", "P": 2, "D": 2, "path": str(out / "dist"),
         "skip_init": True},
    ])
    return {**two, **four, "out": out}


@pytest.fixture(scope="module")
def eager() -> dict[str, torch.Tensor]:
    return ckpt_eager_training()


@pytest.mark.parametrize("name,P,D", [("resume_1x2", 1, 2), ("resume_2x1", 2, 1),
                                      ("resume_2x2", 2, 2)])
def test_resume_on_ranks_equals_uninterrupted(runs: dict, eager: dict, name: str, P: int,
                                              D: int) -> None:
    per_rank = runs[name]
    assert all("error" not in r for r in per_rank), per_rank
    assert sorted((r["stage"], r["replica"]) for r in per_rank) == \
        sorted((s, d) for s in range(P) for d in range(D))
    held: set[str] = set()
    for r in per_rank:
        check(r["state"], eager, f"stage {r['stage']} replica {r['replica']}")
        held |= set(r["state"])
        # every replica got the optimizer state (no silent divergence between replicas)
        assert r["with_state"] > 0
    assert held == set(eager) - {"lm_head.weight"}  # the whole model, unread tensors included
    stage0 = [r for r in per_rank if r["stage"] == 0]
    assert all({"aux_head.weight", "version"} <= set(r["state"]) for r in stage0)


def test_an_error_on_one_rank_stops_every_rank(runs: dict) -> None:
    rank0, rank1 = (r["bad_extra"] for r in runs["save"])
    assert rank0[0] == rank1[0] == "CheckpointError"
    assert "extra must hold plain data" in rank0[1]
    assert "rank 0 failed preparing" in rank1[1] and "plain data" in rank1[1]


def test_a_rank_s_own_model_object_refuses_to_save_a_partial_state(runs: dict) -> None:
    for r in runs["save"]:
        name, message = r["model_state_dict"]
        assert name == "DistributedError"
        assert f"holds only stage {r['stage']}" in message and "save_checkpoint" in message


def test_forgetting_to_load_after_skip_init_stops_every_rank(runs: dict) -> None:
    # each rank holds one stage's tensors, all built by nn.init: both raise, before any send
    for r in runs["forgot"]:
        assert r.get("error") == "UninitializedError", r
        assert "never loaded" in r["message"] and "pipe.load_checkpoint" in r["message"]


def test_ranks_passing_different_paths_all_raise(runs: dict) -> None:
    for r in runs["paths"]:
        name, message = r["errors"]["save"]
        assert name == "CheckpointError"
        assert "ranks passed different paths to save_checkpoint (rank 0: " in message
        assert "ck_0_" in message and "ck_1_" in message
        name, message = r["errors"]["load"]
        assert name == "CheckpointError" and "different paths to load_checkpoint" in message
        assert "ck_good0" in message and "ck_good1" in message
        # nothing was written for the refused save: only the two good checkpoints
        assert r["written"] == ["ck_good0", "ck_good1"], r["written"]


def test_crafted_metadata_runs_no_code_on_any_rank(runs: dict) -> None:
    for r in runs["crafted"]:
        assert r.get("error") == "CheckpointError", r
        assert "DCP metadata refused" in r["message"] and "_operator.getitem" in r["message"]
    assert not (runs["out"] / "ran").exists()


def test_checkpoint_saved_on_ranks_resumes_in_one_process(runs: dict, eager: dict) -> None:
    pipe, _ = one_process(3, runs["out"] / "dist", range(CKPT_SPLIT, CKPT_STEPS), micro=4)
    check({n: t.detach() for n, t in pipe.state_dict().items()}, eager, "P=3 from 2 ranks")


def test_sigterm_to_one_rank_under_torchrun_stops_all_at_one_step(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    job = {"name": "preempt", "kind": "preempt", "P": 2, "D": 1, "dir": str(ckpt),
           "every": 1000, "total": 100000}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "varuna_fx.launch.cli", "run", "--nproc", "2",
         str(SCRIPTS / SCRIPT), str(tmp_path), json.dumps([job])],
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    progress = tmp_path / "progress1"
    deadline = time.monotonic() + 120
    while not (progress.exists() and progress.read_text().strip() not in ("", "0", "1", "2")):
        assert launcher.poll() is None and time.monotonic() < deadline, \
            launcher.communicate()[0][-3000:] if launcher.poll() is not None else "no progress"
        time.sleep(0.1)
    sent = time.time()
    os.kill(int((tmp_path / "pid1").read_text()), signal.SIGTERM)
    output, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, output[-3000:]
    per_rank = [torch.load(tmp_path / f"preempt_rank{r}.pt", weights_only=False)
                for r in range(2)]
    stops = {r["stopped_at"] for r in per_rank}
    assert len(stops) == 1 and all(r["preempted"] for r in per_rank), per_rank
    elapsed = max(r["time"] for r in per_rank) - sent
    print(f"SIGTERM -> every rank saved and left the loop: {elapsed:.2f} s")
    assert elapsed < 30  # torchrun's grace before SIGKILL
    step = stops.pop()
    latest = vf.latest_checkpoint(ckpt)
    assert latest == str(ckpt / f"step{step:08d}")
    pipe = vf.compile(ckpt_model(), example_inputs=(ckpt_tokens()[0, :, :-1],), loss_fn=lm_loss,
                      stages=3, micro_batch_size=2)
    assert pipe.load_checkpoint(latest, optimizer=ckpt_optimizer(pipe.parameters())) == \
        {"step": step}
