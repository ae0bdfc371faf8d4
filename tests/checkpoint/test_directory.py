"""The checkpoint directory protocol (issue 22), in one process and two: latest_checkpoint
orders by sequence, not clocks, and survives junk markers and plain DCP directories; a second
writer to one path is refused (also two real jobs racing); full and read-only filesystems end
in a CheckpointError saying what and where, leaving no .partial."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import varuna_fx as vf
from support.training import compile_mlp
from varuna_fx.checkpoint import directory


def test_latest_checkpoint_orders_by_sequence_not_clocks(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = compile_mlp()
    pipe.save_checkpoint(str(tmp_path / "a"))
    marker = tmp_path / "a" / directory.MARKER
    dated = json.loads(marker.read_text())
    dated["saved_at_ns"] += 10**18  # a marker dated 30 years in the future
    marker.write_text(json.dumps(dated))
    now = __import__("time").time_ns()
    monkeypatch.setattr("varuna_fx.checkpoint.save_load.time.time_ns", lambda: now - 600 * 10**9)
    pipe.save_checkpoint(str(tmp_path / "b"))  # after a restart, the clock 10 minutes behind
    assert vf.latest_checkpoint(tmp_path) == str(tmp_path / "b")
    pipe.save_checkpoint(str(tmp_path / "a"))  # replaced: newest again
    assert vf.latest_checkpoint(tmp_path) == str(tmp_path / "a")


@pytest.mark.parametrize("junk", ['"x"', "null", "NaN", "[1, 2]"])
def test_a_junk_marker_is_skipped_with_a_warning(tmp_path: Path, junk: str) -> None:
    pipe = compile_mlp()
    pipe.save_checkpoint(str(tmp_path / "good"))
    pipe.save_checkpoint(str(tmp_path / "junk"))
    marker = tmp_path / "junk" / directory.MARKER
    text = marker.read_text()
    marker.write_text(text.replace(f'"saved_at_ns": {json.loads(text)["saved_at_ns"]}',
                                   f'"saved_at_ns": {junk}'))
    with pytest.warns(UserWarning, match=r"skipping .*junk: .*saved_at_ns is"):
        assert vf.latest_checkpoint(tmp_path) == str(tmp_path / "good")
    marker.write_text("[1, 2]")  # a marker that is no JSON object at all
    with pytest.warns(UserWarning, match=r"skipping .*junk: .*holds a JSON list"):
        assert vf.latest_checkpoint(tmp_path) == str(tmp_path / "good")
    with pytest.raises(vf.CheckpointError, match="holds a JSON list, not an object"):
        pipe.load_checkpoint(str(tmp_path / "junk"))


def test_a_plain_dcp_directory_is_named_as_such(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    pipe = compile_mlp()
    pipe.save_checkpoint(str(tmp_path / "ours"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's own single-process warning
        dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    with pytest.warns(UserWarning, match=r"skipping .*plain: a torch.distributed.checkpoint "
                      r"directory without varuna_fx's .*not a varuna_fx checkpoint") as caught:
        assert vf.latest_checkpoint(tmp_path) == str(tmp_path / "ours")
    assert not any("interrupted" in str(w.message) for w in caught)
    with pytest.raises(vf.CheckpointError, match="plain torch.distributed.checkpoint directory"):
        pipe.load_checkpoint(str(tmp_path / "plain"))


# -- two writers, full and read-only disks --------------------------------------------------------


def test_a_second_writer_to_one_path_is_refused(tmp_path: Path) -> None:
    pipe = compile_mlp()
    path = str(tmp_path / "ckpt")
    held = directory.lock(path)  # what another job saving to the same path holds
    try:
        with pytest.raises(vf.CheckpointError, match=r"another process is saving to .*ckpt "
                           r"\(it holds .*ckpt\.lock\)"):
            pipe.save_checkpoint(path)
        assert not (tmp_path / "ckpt.partial").exists()  # the loser touched nothing
        with pytest.raises(vf.CheckpointError, match="another process is saving"):
            pipe.save_checkpoint(path, async_save=True)
    finally:
        directory.unlock(path, held)
    pipe.save_checkpoint(path)
    pipe.save_checkpoint(path, async_save=True).result()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no lock file, no partial


def test_a_filesystem_without_flock_saves_with_a_warning(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import fcntl

    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    pipe = compile_mlp()
    with pytest.warns(UserWarning, match="does not support flock: saving without the lock"):
        pipe.save_checkpoint(str(tmp_path / "c"))
    assert vf.latest_checkpoint(tmp_path) == str(tmp_path / "c")
    assert [p.name for p in tmp_path.iterdir()] == ["c"]


RACER = """
import sys, torch, varuna_fx as vf
from torch import nn
torch.manual_seed(0)
pipe = vf.compile(nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]),
                  example_inputs=(torch.randn(2, 256),), loss_fn=lambda o, t: o.sum(), stages=2)
print("ready", flush=True)
sys.stdin.readline()
for i in range(6):
    try:
        pipe.save_checkpoint(sys.argv[1])
        print("saved", flush=True)
    except vf.CheckpointError as exc:
        print("refused", str(exc).splitlines()[0], flush=True)
"""


@pytest.mark.slow  # two processes
def test_two_jobs_saving_to_one_path_never_interleave(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(vf.__file__).parents[1])}
    path = tmp_path / "shared"
    jobs = [subprocess.Popen([sys.executable, "-c", RACER, str(path)], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT) for _ in range(2)]
    for job in jobs:
        assert job.stdout is not None and job.stdout.readline().strip() == "ready"
    for job in jobs:  # both start saving at once
        assert job.stdin is not None
        job.stdin.write("go\n")
        job.stdin.flush()
    outputs = [job.communicate(timeout=120)[0] for job in jobs]
    lines = [line for out in outputs for line in out.splitlines()]
    assert all(job.returncode == 0 for job in jobs), outputs  # no raw FileNotFoundError
    assert all(line == "saved" or "another process is saving to" in line for line in lines), \
        outputs
    assert lines.count("saved") >= 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared"]
    assert (path / ".metadata").exists() and (path / directory.MARKER).exists()
    assert vf.latest_checkpoint(tmp_path) == str(path)


FULL_DISK = """
import json, os, subprocess, sys, torch, varuna_fx as vf
from torch import nn
mount = sys.argv[1]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mount], check=True)
torch.manual_seed(0)
pipe = vf.compile(nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)),
                  example_inputs=(torch.randn(2, 256),), loss_fn=lambda o, t: o.sum(), stages=2)
opt = torch.optim.Adam(pipe.parameters())
pipe.step(torch.randn(2, 256), target=torch.zeros(2)); opt.step()
out = {}
def attempt(name, path, **kw):
    try:
        handle = pipe.save_checkpoint(path, **kw)
        if handle is not None:
            handle.result()
        out[name] = "saved"
    except vf.CheckpointError as exc:
        out[name] = str(exc)
    out[name + "_left"] = sorted(os.listdir(mount))
attempt("full", f"{mount}/step1", optimizer=opt)  # model + 2 moments: ~1.5 MiB
attempt("smaller", f"{mount}/step2")  # the model alone: ~0.5 MiB
attempt("async_full", f"{mount}/step3", optimizer=opt, async_save=True)
subprocess.run(["mount", "-o", "remount,ro", mount], check=True)
attempt("read_only", f"{mount}/step4")
print(json.dumps(out))
"""


@pytest.mark.slow  # a subprocess in its own mount namespace
def test_full_and_read_only_filesystems_say_what_and_where(tmp_path: Path) -> None:
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs unshare -m (a private mount namespace) to mount a small tmpfs")
    mount = tmp_path / "disk"
    mount.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(vf.__file__).parents[1])}
    run = subprocess.run(["unshare", "-m", sys.executable, "-c", FULL_DISK, str(mount)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    out = json.loads(run.stdout.splitlines()[-1])
    assert "writing" in out["full"] and "No space left on device" in out["full"] and \
        "the disk is full" in out["full"] and f"{mount}/step1" in out["full"], out
    assert out["full_left"] == [], out  # no stale .partial holds the space
    assert out["smaller"] == "saved", out
    assert "the disk is full" in out["async_full"] and out["async_full_left"] == ["step2"], out
    assert "Read-only file system" in out["read_only"] and \
        "save to a writable directory" in out["read_only"] and \
        f"{mount}/step4" in out["read_only"], out
