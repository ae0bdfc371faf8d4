"""In-place morphing on gloo processes: the survivors keep running, and every step's loss and the
final parameters equal an uninterrupted one-process run (the tiny GPT in float64, so every
layout agrees with eager to rounding; ``tests/dist_scripts/in_place_train.py``).

* a spot notice (SIGTERM) to the process of stage 1 of P=2: it hands its stage over at the next
  step boundary and exits; the survivor runs P=1; then a new process joins and the job grows
  back to two processes (ZeRO-1 over D=2: the joiner takes half the optimizer state);
* a process SIGKILLed mid-run (D=2, every replica holds the whole state): the survivor re-runs
  the step in flight on the new layout, its lost share of the batch cut again by the loader;
* a stage whose only holder vanishes: in place cannot continue, and the survivor exits asking
  its launcher to start it again (the restart path, from the latest checkpoint).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.in_place import ROOT, InPlaceJob, launcher_env
from support.ranks import free_port
from varuna_fx.morph.controller import RESTART_EXIT

SCRIPT = str(ROOT / "tests" / "dist_scripts" / "in_place_train.py")
STEPS = "9"  # every run's, so that final parameters compare with the reference's


def _log(out: Path) -> list[list[str]]:
    log = out / "log"
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run: one process, no membership store."""
    out = tmp_path_factory.mktemp("reference")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"),
               CUDA_VISIBLE_DEVICES="")
    env.pop("VARUNA_FX_STORE", None)
    subprocess.run([sys.executable, SCRIPT, str(out), STEPS], env=env, check=True, timeout=300)
    return {"losses": {int(r[0]): float(r[-1]) for r in _log(out)},
            **torch.load(out / "solo.pt")}


def _check(out: Path, member: str, reference: dict) -> dict:
    """Every logged step's loss and ``member``'s final parameters equal the reference."""
    rows = _log(out)
    losses = {int(r[0]): float(r[-1]) for r in rows}
    assert sorted(losses) == list(range(1, len(losses) + 1)) and len(rows) == len(losses), rows
    # (rtol: the distributed loss itself travels in float32 on some layouts; the parameters,
    # which carry every step's numbers, are compared at float64's defaults)
    torch.testing.assert_close(torch.tensor([losses[s] for s in sorted(losses)]),
                               torch.tensor([reference["losses"][s] for s in sorted(losses)]),
                               rtol=1e-6, atol=0)
    got = torch.load(out / f"{member}.pt")
    for name, value in got["params"].items():
        torch.testing.assert_close(value, reference["params"][name], msg=name)
    assert got["lr"] == reference["lr"]
    return got


@pytest.mark.slow
@pytest.mark.distributed
def test_notice_shrinks_and_a_join_grows_back(tmp_path: Path, reference: dict) -> None:
    """D=2 with ZeRO-1: the leaver hands over its optimizer shard; the joiner takes half."""
    go = tmp_path / "go"
    argv = [SCRIPT, str(tmp_path), STEPS, "--stages", "1", "--notice", "3:m1",
            "--pause", f"5:{go}"]
    with InPlaceJob(tmp_path, min_world=2) as job:
        job.start("m0", argv)
        leaver = job.start("m1", argv)
        job.wait_until("the leaver to hand over and exit", lambda: leaver.poll() is not None)
        assert leaver.returncode == 0, job.tails()
        job.start("m2", argv)  # a machine comes back
        job.wait_until("the new process to register", lambda: job.registered() >= 3)
        go.write_text("1")
        codes = job.finish()
    assert codes == {"m0": 0, "m1": 0, "m2": 0}, job.tails()
    worlds = [int(r[1]) for r in _log(tmp_path)]
    assert worlds[:4] == [2, 2, 2, 1] and worlds[-1] == 2, worlds
    survivor = _check(tmp_path, "m0", reference)
    notice, join = survivor["morphs"]
    assert (notice["reason"], notice["left"]) == ("notice", ["m1"])
    assert notice["old_layout"].startswith("P=1 D=2") and notice["new_layout"].startswith("P=1 D=1")
    assert notice["signal_at"] is not None
    assert (join["reason"], join["joined"]) == ("join", ["m2"])
    assert join["new_layout"].startswith("P=1 D=2")
    joiner = _check(tmp_path, "m2", reference)
    assert [m["reason"] for m in joiner["morphs"]] == ["joined"]
    assert "joined a running in-place job" in joiner["refused_load"]
    # moved: the leaver's half of AdamW's two moments to the survivor; then all weights and
    # half the moments to the joiner -- never a whole copy of the state
    weights = sum(v.numel() * v.element_size() for v in survivor["params"].values())
    assert 0.9 * weights < notice["bytes_moved"] < 1.1 * weights
    assert 1.9 * weights < join["bytes_moved"] < 2.1 * weights


@pytest.mark.slow
@pytest.mark.distributed
def test_notice_repartitions_the_pipeline(tmp_path: Path, reference: dict) -> None:
    """P=2 -> P=1: the survivor takes stage 1's weights and optimizer state from the leaver.
    Launched as a user does (``varuna-fx run --elastic --in-place``: the shared launch starts
    the in-place launcher, which hosts the store and starts both workers)."""
    launched = subprocess.run(
        [sys.executable, "-m", "varuna_fx.launch.cli", "run", "--elastic", "--in-place",
         "--nproc", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
         SCRIPT, str(tmp_path), STEPS, "--stages", "2", "--notice", "2:.1.0"],
        env=launcher_env(), capture_output=True, text=True, timeout=300)
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    assert [int(r[2]) for r in _log(tmp_path)] == [2, 2] + [1] * 7  # P per step
    (survivor_file,) = tmp_path.glob("*.0.0.pt")  # local rank 0's first start
    survivor = _check(tmp_path, survivor_file.stem, reference)
    (notice,) = survivor["morphs"]
    assert notice["old_layout"].startswith("P=2 D=1") and notice["new_layout"].startswith("P=1")
    assert notice["bytes_moved"] == notice["bytes_received"] > 0


@pytest.mark.slow
@pytest.mark.distributed
def test_a_vanished_process_loses_only_the_step_in_flight(tmp_path: Path,
                                                          reference: dict) -> None:
    argv = [SCRIPT, str(tmp_path), STEPS, "--stages", "1", "--shard", "false", "--kill",
            "3:m1"]
    with InPlaceJob(tmp_path, min_world=2) as job:
        job.start("m0", argv)
        job.start("m1", argv)
        codes = job.finish()
    assert codes == {"m0": 0, "m1": -9}, job.tails()
    assert [int(r[1]) for r in _log(tmp_path)] == [2, 2] + [1] * 7
    survivor = _check(tmp_path, "m0", reference)
    (lost,) = survivor["morphs"]
    assert (lost["reason"], lost["lost"]) == ("lost", ["m1"])
    assert lost["old_layout"].startswith("P=1 D=2") and lost["new_layout"].startswith("P=1 D=1")
    assert lost["bytes_moved"] == 0  # the surviving replica held everything the new layout needs


@pytest.mark.slow
@pytest.mark.distributed
def test_state_without_a_live_holder_restarts_from_the_checkpoint(tmp_path: Path) -> None:
    argv = [SCRIPT, str(tmp_path), STEPS, "--stages", "2", "--kill", "3:m1"]
    with InPlaceJob(tmp_path, min_world=2) as job:
        job.start("m0", argv)
        job.start("m1", argv)
        codes = job.finish()
        record = job.store.get("gen/2")
    assert codes == {"m0": RESTART_EXIT, "m1": -9}, job.tails()
    assert "no live process holds" in (tmp_path / "m0.out").read_text()
    assert b'"reason": "restart"' in record  # whoever registers next starts the job again
