"""Checkpoints that run no code and cannot be silently broken (issue 22), in one process:
crafted metadata and pickled entries are refused before they run; a bit flip is caught by the
per-entry checksum; a failed load refuses to step until a load succeeds; latest_checkpoint
orders by sequence, not clocks, and survives junk markers; a second writer to one path is
refused; full and read-only filesystems, bad `extra` values, tampered and foreign
checkpoints and plain DCP directories each end in a CheckpointError saying what and where."""

from __future__ import annotations

import builtins
import json
import operator
import os
import pickle
import shutil
import subprocess
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

import varuna_fx as vf
from varuna_fx.checkpoint import directory, raw_storage
from varuna_fx.checkpoint.raw_storage import ChecksummedInfo, byte_view

# several tests load the optimizer-carrying fixture without an optimizer (the warning is tested
# in test_checkpoint.py)
pytestmark = pytest.mark.filterwarnings("ignore:.*no optimizer was passed:UserWarning")


def compile_mlp(seed: int = 0, stages: int = 2) -> vf.Pipeline:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4)).double()
    return vf.compile(model, example_inputs=(torch.randn(4, 8, dtype=torch.float64),),
                      loss_fn=nn.functional.mse_loss, stages=stages, micro_batch_size=2)


def step(pipe: vf.Pipeline, opt: torch.optim.Optimizer | None = None) -> float:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 8, dtype=torch.float64, generator=g)
    pipe.zero_grad()
    loss = float(pipe.step(x, target=torch.zeros(4, 4, dtype=torch.float64)))
    if opt is not None:
        opt.step()
    return loss


def weights(pipe: vf.Pipeline) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in pipe.state_dict().items()}


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    pipe = compile_mlp()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    step(pipe, opt)
    path = tmp_path / "ckpt"
    pipe.save_checkpoint(str(path), optimizer=opt, extra={"step": 1})
    return path


def metadata_of(path: Path) -> Metadata:
    return pickle.loads((path / ".metadata").read_bytes())  # the test wrote it: trusted


def write_metadata(path: Path, metadata: Any) -> None:
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


def record(path: Path, key: str) -> tuple[Path, ChecksummedInfo]:
    info = next(v for k, v in metadata_of(path).storage_data.items() if k.fqn == key)
    return path / info.relative_path, info


def replace_entry(path: Path, key: str, tensor: torch.Tensor) -> None:
    """Point ``key`` at new bytes (appended to a new file), with a matching checksum."""
    metadata = metadata_of(path)
    data = bytes(byte_view(tensor.contiguous()))
    (path / "tampered.raw").write_bytes(data)
    index = next(k for k in metadata.storage_data if k.fqn == key)
    metadata.storage_data[index] = ChecksummedInfo("tampered.raw", 0, len(data),
                                                   crc32=zlib.crc32(data))
    entry = metadata.state_dict_metadata[key]
    entry.size = tensor.size()
    entry.chunks[0].sizes = tensor.size()
    write_metadata(path, metadata)


class RunsCode:
    """Unpickling this calls builtins.exec, which writes ``flag``."""

    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def __reduce__(self) -> tuple:
        return builtins.exec, (f"open({str(self.flag)!r}, 'w').write('ran')",)


class Stealthy:
    """Runs the code, then unpickles to the genuine metadata: a plain load succeeds."""

    def __init__(self, flag: Path, genuine: Metadata) -> None:
        self.flag, self.genuine = flag, genuine

    def __reduce__(self) -> tuple:
        return operator.getitem, ((RunsCode(self.flag), self.genuine), 1)


# -- code execution ------------------------------------------------------------------------------


@pytest.mark.parametrize("stealthy", [False, True])
def test_crafted_metadata_is_refused_before_it_runs(saved: Path, tmp_path: Path,
                                                    stealthy: bool) -> None:
    flag = tmp_path / "ran"
    payload = Stealthy(flag, metadata_of(saved)) if stealthy else RunsCode(flag)
    write_metadata(saved, payload)
    pipe = compile_mlp(seed=1)
    before = weights(pipe)
    refused = "_operator.getitem" if stealthy else "builtins.exec"  # the first global
    with pytest.raises(vf.CheckpointError, match=rf"DCP metadata refused .*{refused}: not part "
                       r"of DCP's checkpoint metadata.*never runs code"):
        pipe.load_checkpoint(str(saved))
    assert not flag.exists()
    for name, value in weights(pipe).items():  # refused before anything was read
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)
    step(pipe)  # and the pipeline still runs


def test_a_pickled_entry_is_refused_unread(saved: Path, tmp_path: Path) -> None:
    """DCP's BYTE_IO entries are torch.load(weights_only=False)-ed by its planner."""
    flag = tmp_path / "ran"
    metadata = metadata_of(saved)
    metadata.state_dict_metadata["obj/meta"] = BytesStorageMetadata()
    data = pickle.dumps(RunsCode(flag))
    (saved / "evil.raw").write_bytes(data)
    index = next(k for k in metadata.storage_data if k.fqn == "obj/meta")
    metadata.storage_data[index] = ChecksummedInfo("evil.raw", 0, len(data))
    write_metadata(saved, metadata)
    with pytest.raises(vf.CheckpointError, match="holds other than tensors under, obj/meta"):
        compile_mlp().load_checkpoint(str(saved))
    assert not flag.exists()


def test_the_load_planner_never_unpickles(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    from varuna_fx.checkpoint import dcp_local
    from varuna_fx.checkpoint.raw_storage import RawReader, RawWriter
    from varuna_fx.checkpoint.safe_metadata import LegacyReader, SafeLoadPlanner

    flag = tmp_path / "ran"
    dcp_local.save({"obj": RunsCode(flag)}, RawWriter(str(tmp_path / "c")),
                   DefaultSavePlanner(flatten_state_dict=False))
    for planner in (SafeLoadPlanner, DefaultLoadPlanner):  # the reader refuses it unread
        with pytest.raises(vf.CheckpointError, match="obj is a pickled object"):
            dcp_local.load({"obj": None}, RawReader(str(tmp_path / "c")),
                           planner(flatten_state_dict=False))
    # the format-1 reader (DCP's own records) hands the bytes to the planner, which refuses
    dcp_local.save({"obj": RunsCode(flag)}, FileSystemWriter(str(tmp_path / "f")),
                   DefaultSavePlanner(flatten_state_dict=False))
    with pytest.raises(vf.CheckpointError, match="obj is a pickled object"):
        dcp_local.load({"obj": None}, LegacyReader(str(tmp_path / "f")),
                       SafeLoadPlanner(flatten_state_dict=False))
    assert not flag.exists()


# -- silently wrong: bit flips, orders -----------------------------------------------------------


def test_a_bit_flip_is_named_and_the_pipeline_refuses_to_step(saved: Path) -> None:
    file, info = record(saved, "model/2.weight")
    data = bytearray(file.read_bytes())
    data[info.offset + info.length // 2] ^= 0x10
    file.write_bytes(bytes(data))
    pipe = compile_mlp(seed=1)
    with pytest.raises(vf.CheckpointError, match=rf"{file.name}: the bytes of model/2\.weight "
                       r".* do not match the checksum"):
        pipe.load_checkpoint(str(saved))
    with pytest.raises(vf.CheckpointError, match=r"load_checkpoint\(.*ckpt'\) failed partway "
                       r".*load a checkpoint successfully before stepping"):
        step(pipe)
    data[info.offset + info.length // 2] ^= 0x10  # repaired: the load succeeds, steps run
    file.write_bytes(bytes(data))
    assert pipe.load_checkpoint(str(saved)) == {"step": 1}
    step(pipe)


def test_a_truncated_shard_leaves_a_pipeline_that_refuses_to_step(saved: Path,
                                                                  tmp_path: Path) -> None:
    good = tmp_path / "good"
    shutil.copytree(saved, good)
    for raw in saved.glob("*.raw"):
        raw.write_bytes(raw.read_bytes()[: raw.stat().st_size * 2 // 3])
    pipe = compile_mlp(seed=1)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(vf.CheckpointError, match="damaged or incomplete"):
        pipe.load_checkpoint(str(saved), optimizer=opt)
    assert not opt.state  # the optimizer was not touched
    with pytest.raises(vf.CheckpointError, match="may hold a mix of the checkpoint's values"):
        step(pipe, opt)
    with pytest.raises(vf.CheckpointError, match="failed partway"):
        step(pipe.eval())
    pipe.train()
    pipe.load_checkpoint(str(good), optimizer=opt)
    step(pipe, opt)


def test_checkpoints_without_checksums_still_load_but_stripped_ones_do_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = compile_mlp()
    with monkeypatch.context() as m:  # what varuna_fx wrote before checksums (format 2)
        m.setattr(raw_storage.RawWriter, "checksums", False)
        m.setattr("varuna_fx.checkpoint.save_load.FORMAT", 2)
        pipe.save_checkpoint(str(tmp_path / "v2"))
    compile_mlp(seed=1).load_checkpoint(str(tmp_path / "v2"))
    pipe.save_checkpoint(str(tmp_path / "v3"))
    metadata = metadata_of(tmp_path / "v3")
    for index, info in metadata.storage_data.items():
        metadata.storage_data[index] = ChecksummedInfo(info.relative_path, info.offset,
                                                       info.length)
    write_metadata(tmp_path / "v3", metadata)
    with pytest.raises(vf.CheckpointError, match="has no checksum"):
        compile_mlp(seed=1).load_checkpoint(str(tmp_path / "v3"))


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


# -- silently accepted: param groups -------------------------------------------------------------


def test_one_saved_param_group_loaded_into_two_is_refused(tmp_path: Path) -> None:
    pipe = compile_mlp()
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3, weight_decay=0.1)
    step(pipe, opt)
    pipe.save_checkpoint(str(tmp_path / "c"), optimizer=opt)
    named = dict(pipe.named_parameters())
    two = torch.optim.AdamW([
        {"params": [p for n, p in named.items() if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for n, p in named.items() if n.endswith("bias")], "weight_decay": 0.0,
         "lr": 5e-4}])
    with pytest.raises(vf.CheckpointError, match="param groups 0 and 1 of the optimizer were "
                       "one param group when saved"):
        pipe.load_checkpoint(str(tmp_path / "c"), optimizer=two)
    assert [g["weight_decay"] for g in two.param_groups] == [0.1, 0.0]
    assert two.param_groups[1]["lr"] == 5e-4


# -- raw or misleading: extra, tampered and foreign checkpoints ----------------------------------


@pytest.mark.parametrize("value,where,kind", [
    ({"lr": np.float64(0.1)}, r"extra\['lr'\]", "numpy.float64"),
    ({"sched": {"fn": lambda e: 0.9 ** e}}, r"extra\['sched'\]\['fn'\]", "builtins.function"),
    ({"hist": [1, np.zeros(2)]}, r"extra\['hist'\]\[1\]", "numpy.ndarray"),
])
def test_extra_names_the_key_and_type_it_cannot_hold(tmp_path: Path, value: dict, where: str,
                                                     kind: str) -> None:
    with pytest.raises(vf.CheckpointError, match=rf"{where} is a {kind}.*Allowed: None, bool"):
        compile_mlp().save_checkpoint(str(tmp_path / "c"), extra=value)
    assert not any(tmp_path.iterdir())


def test_extra_may_hold_plain_data(tmp_path: Path) -> None:
    extra = {"step": 3, "lr": 0.5, "name": "run", "none": None, "t": torch.ones(2),
             "nested": {"a": [1, (2, 3.0)], 4: {"b"}}, "dtype": torch.float16}
    pipe = compile_mlp()
    pipe.save_checkpoint(str(tmp_path / "c"), extra=extra)
    back = compile_mlp().load_checkpoint(str(tmp_path / "c"))
    assert back.keys() == extra.keys() and back["nested"] == extra["nested"]
    torch.testing.assert_close(back["t"], extra["t"])


def tamper_marker(path: Path, text: str) -> None:
    (path / directory.MARKER).write_text(text)


def drop_entry(path: Path, key: str) -> None:
    metadata = metadata_of(path)
    del metadata.state_dict_metadata[key]
    write_metadata(path, metadata)


@pytest.mark.parametrize("tamper,message", [
    (lambda p: tamper_marker(p, "[]"), "holds a JSON list, not an object"),
    (lambda p: tamper_marker(p, '{"format": "2"}'), r"format is '2', not int"),
    (lambda p: tamper_marker(p, '{"format": 3, "optimizer": 5}'), "optimizer is 5"),
    (lambda p: drop_entry(p, "obj/meta"), "lacks, or holds other than tensors under, obj/meta"),
    (lambda p: replace_entry(p, "obj/meta", raw_storage_encode({"extra": {}})),
     r"holds something varuna_fx did not write \(KeyError"),
    (lambda p: replace_entry(p, "optim_group/0.weight", torch.zeros(0, dtype=torch.int64)),
     r"holds something varuna_fx did not write \(IndexError"),
    (lambda p: replace_entry(p, "obj/meta", torch.arange(40, dtype=torch.uint8)),
     "holds something varuna_fx did not write"),
    (lambda p: write_metadata(p, {"not": "metadata"}), "a dict, not a Metadata"),
    (lambda p: (p / ".metadata").write_bytes(b"\x80\x04garbage"), "DCP metadata refused"),
])
def test_tampered_checkpoints_raise_checkpoint_errors(saved: Path, tamper: Any,
                                                      message: str) -> None:
    tamper(saved)
    pipe = compile_mlp(seed=1)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(vf.CheckpointError, match=message):
        pipe.load_checkpoint(str(saved), optimizer=opt)


def raw_storage_encode(obj: Any) -> torch.Tensor:
    from varuna_fx.checkpoint.optimizer_state import encode

    return encode(obj)


def test_metadata_naming_files_outside_the_checkpoint_is_refused(saved: Path) -> None:
    metadata = metadata_of(saved)
    index = next(iter(metadata.storage_data))
    info = metadata.storage_data[index]
    metadata.storage_data[index] = ChecksummedInfo("../../etc/passwd", 0, info.length)
    write_metadata(saved, metadata)
    with pytest.raises(vf.CheckpointError, match="names the file '../../etc/passwd'"):
        compile_mlp().load_checkpoint(str(saved))
