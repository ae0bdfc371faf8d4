"""Checkpoints that run no code and cannot be silently broken (issue 22), in one process:
crafted metadata and pickled entries are refused before they run; a bit flip is caught by the
per-entry checksum; a failed load refuses to step until a load succeeds; param groups that
were one are refused; bad `extra` values and tampered or foreign checkpoints end in a
CheckpointError saying what and where. The directory protocol (order, locks, full disks):
test_checkpoint_directory.py."""

from __future__ import annotations

import pickle
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

import varuna_fx as vf
from support.payloads import RunsCode, Stealthy
from support.training import compile_mlp, step, weights
from varuna_fx.checkpoint import directory, raw_storage
from varuna_fx.checkpoint.raw_storage import ChecksummedInfo, byte_view, entry_header

# several tests load the optimizer-carrying fixture without an optimizer (the warning is tested
# in test_checkpoint.py)
pytestmark = pytest.mark.filterwarnings("ignore:.*no optimizer was passed:UserWarning")


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
    """Point ``key`` at new bytes (appended to a new file), with a matching checksum bound to
    the entry (as varuna_fx would have written it)."""
    metadata = metadata_of(path)
    data = bytes(byte_view(tensor.contiguous()))
    (path / "tampered.raw").write_bytes(data)
    index = next(k for k in metadata.storage_data if k.fqn == key)
    header = entry_header(key, index.offset, tensor.size(), tensor.size(), tensor.dtype,
                          "tampered.raw", 0, len(data))
    metadata.storage_data[index] = ChecksummedInfo(
        "tampered.raw", 0, len(data), crc32=zlib.crc32(data, zlib.crc32(header)), bound=True)
    entry = metadata.state_dict_metadata[key]
    entry.size = tensor.size()
    entry.chunks[0].sizes = tensor.size()
    entry.properties.dtype = tensor.dtype
    write_metadata(path, metadata)


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


def test_entries_swapped_with_their_checksums_are_refused(saved: Path) -> None:
    """Two equal-shaped entries exchanged in the metadata, checksums and all: each checksum
    holds only for its own key (issue 30), so the load names the entry instead of loading the
    weights exchanged."""
    metadata = metadata_of(saved)
    first, second = (next(k for k in metadata.storage_data if k.fqn == f"model/{n}.bias")
                     for n in (0, 2))
    metadata.storage_data[first], metadata.storage_data[second] = \
        metadata.storage_data[second], metadata.storage_data[first]
    write_metadata(saved, metadata)
    with pytest.raises(vf.CheckpointError, match=r"the bytes of model/[02]\.bias .* do not "
                       r"match the checksum written with them for this entry.*swapped"):
        compile_mlp(seed=1).load_checkpoint(str(saved))


@pytest.mark.parametrize("target", ["data", "metadata"])
def test_a_file_linked_out_of_the_checkpoint_is_refused(saved: Path, tmp_path: Path,
                                                        target: str) -> None:
    """A data file (or the metadata) replaced by a symlink to a copy outside the checkpoint:
    docs/checkpoints.md promises files outside the directory are refused."""
    file = record(saved, "model/2.weight")[0] if target == "data" else saved / ".metadata"
    outside = tmp_path / "elsewhere" / file.name
    outside.parent.mkdir()
    shutil.copy(file, outside)
    file.unlink()
    file.symlink_to(outside)
    with pytest.raises(vf.CheckpointError, match=rf"{file.name} resolves to .*elsewhere.*"
                       "outside the checkpoint"):
        compile_mlp(seed=1).load_checkpoint(str(saved))
    file.unlink()  # a link inside the checkpoint to its own file is fine
    (saved / "moved").mkdir()
    shutil.move(outside, saved / "moved" / file.name)
    file.symlink_to(saved / "moved" / file.name)
    assert compile_mlp(seed=1).load_checkpoint(str(saved)) == {"step": 1}


def test_format_3_checksums_of_the_bytes_alone_still_load(saved: Path) -> None:
    """Checkpoints written before the checksums were bound to their entries load, verified by
    the bytes; a format-4 marker over such metadata is refused."""
    metadata = metadata_of(saved)
    for index, info in metadata.storage_data.items():
        data = (saved / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
        old = ChecksummedInfo(info.relative_path, info.offset, info.length,
                              crc32=zlib.crc32(data))
        del old.__dict__["bound"]  # as format 3 pickled it: no such field
        metadata.storage_data[index] = old
    write_metadata(saved, metadata)
    with pytest.raises(vf.CheckpointError, match="has no checksum bound to its name"):
        compile_mlp(seed=1).load_checkpoint(str(saved))
    marker = saved / directory.MARKER
    marker.write_text(marker.read_text().replace('"format": 4', '"format": 3'))
    pipe = compile_mlp(seed=1)
    assert pipe.load_checkpoint(str(saved)) == {"step": 1}
    original = compile_mlp()  # what the fixture saved: its weights after one step
    step(original, torch.optim.SGD(original.parameters(), lr=0.1, momentum=0.9))
    torch.testing.assert_close(weights(pipe), weights(original), rtol=0, atol=0)


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
