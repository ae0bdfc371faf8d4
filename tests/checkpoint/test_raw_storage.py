"""The raw-bytes DCP storage (checkpoint/raw_storage.py) and the one-process DCP driver
(checkpoint/dcp_local.py): every dtype and shape round-trips bit-exactly, destinations that are not
plain contiguous tensors of the stored dtype still load (cast, strided), a chunk of a stored
tensor reads the right bytes, format-1 checkpoints (DCP's torch.save records) still load, and
one-process saves and loads raise no DCP warning."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

import varuna_fx as vf
from support.training import ckpt_model, ckpt_optimizer, ckpt_tokens
from varuna_fx.checkpoint import dcp_local
from varuna_fx.checkpoint import save_load as ckpt_module
from varuna_fx.checkpoint.raw_storage import RawReader, RawWriter
from varuna_fx.examples import lm_loss


def sample_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(7, 5, generator=g),
        "f64": torch.randn(3, 4, 2, generator=g, dtype=torch.float64),
        "bf16": torch.randn(9, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 3, generator=g).half(),
        "i64": torch.randint(-2**40, 2**40, (6,), generator=g),
        "u8": torch.randint(0, 255, (11,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(5, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(6, 4, generator=g).t(),  # not contiguous when saved
    }


def save(state: dict[str, torch.Tensor], path: Path, threads: int = 3) -> None:
    dcp_local.save(state, RawWriter(str(path), thread_count=threads),
                   DefaultSavePlanner(flatten_state_dict=False))


def load(dest: dict[str, torch.Tensor], path: Path) -> None:
    dcp_local.load(dest, RawReader(str(path)), DefaultLoadPlanner(flatten_state_dict=False))


def test_every_dtype_and_shape_round_trips_exactly(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    state = sample_state()
    monkeypatch.setattr(RawWriter, "bytes_per_file", 64)  # several files even for tiny state
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "assuming a single process" warning either
        save(state, tmp_path / "c")
        dest = {k: torch.full_like(v.contiguous(), 7) for k, v in state.items()}
        where = {k: v.data_ptr() for k, v in dest.items()}
        load(dest, tmp_path / "c")
    for k, v in state.items():
        assert dest[k].dtype == v.dtype and torch.equal(dest[k], v), k
        assert dest[k].data_ptr() == where[k], k  # read into the tensor passed, no new one
    assert len(list((tmp_path / "c").glob("*.raw"))) == 3  # one file per writer thread
    monkeypatch.undo()
    save(state, tmp_path / "small")
    assert len(list((tmp_path / "small").glob("*.raw"))) == 1  # small: one file, one fsync


def test_cast_and_strided_destinations(tmp_path: Path) -> None:
    state = sample_state()
    save(state, tmp_path / "c", threads=1)
    cast = torch.zeros(7, 5, dtype=torch.float64)  # another dtype: read, then cast
    strided = torch.zeros(6, 4).t()  # not contiguous: read, then copy
    base = strided.data_ptr()
    load({"f32": cast, "strided": strided}, tmp_path / "c")
    torch.testing.assert_close(cast, state["f32"].double(), rtol=0, atol=0)
    torch.testing.assert_close(strided, state["strided"], rtol=0, atol=0)
    assert strided.data_ptr() == base


def test_a_chunk_of_a_stored_tensor(tmp_path: Path) -> None:
    """The load planner may ask for part of a stored tensor (re-sharding): rows 2..4."""
    state = {"w": torch.arange(24.0).reshape(6, 4)}
    save(state, tmp_path / "c", threads=1)
    reader = RawReader(str(tmp_path / "c"))
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    dest = torch.zeros(3, 4)

    class Planner:
        def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
            return dest

        def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
            assert tensor.data_ptr() == dest.data_ptr()

    index = MetadataIndex("w", (0, 0), 0)
    item = ReadItem(LoadItemType.TENSOR, MetadataIndex("w", (0, 0)), torch.Size((0, 0)), index,
                    torch.Size((2, 0)), torch.Size((3, 4)))
    with open(tmp_path / "c" / metadata.storage_data[index].relative_path, "rb") as f:
        reader._read_item(f, item, Planner())
    torch.testing.assert_close(dest, state["w"][2:5], rtol=0, atol=0)


def compile_small() -> vf.Pipeline:
    data = ckpt_tokens()
    return vf.compile(ckpt_model(), example_inputs=(data[0, :, :-1],), loss_fn=lm_loss,
                      stages=2, micro_batch_size=2)


def test_format_1_checkpoints_still_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints written before the raw storage (DCP's own writer, format 1) load as before."""
    from torch.distributed.checkpoint import FileSystemWriter

    pipe = compile_small()
    opt = ckpt_optimizer(pipe.parameters())
    data = ckpt_tokens()
    pipe.step(data[0, :, :-1], target=data[0, :, 1:])
    opt.step()
    with monkeypatch.context() as m:
        m.setattr(ckpt_module, "RawWriter", FileSystemWriter)
        m.setattr(ckpt_module, "FORMAT", 1)
        pipe.save_checkpoint(str(tmp_path / "old"), optimizer=opt)
    assert not list((tmp_path / "old").glob("*.raw"))
    other = compile_small()
    opt2 = ckpt_optimizer(other.parameters())
    other.load_checkpoint(str(tmp_path / "old"), optimizer=opt2)
    for (name, a), b in zip(pipe.state_dict().items(), other.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    for p, q in zip(pipe.parameters(), other.parameters()):
        for key, value in opt.state[p].items():
            torch.testing.assert_close(opt2.state[q][key], value, rtol=0, atol=0)


def test_one_process_save_and_load_raise_no_warning(tmp_path: Path) -> None:
    """DCP's "assuming the intent is to save in a single process" used to appear on every
    one-process save and load (also on the async writer thread)."""
    pipe = compile_small()
    opt = ckpt_optimizer(pipe.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.save_checkpoint(str(tmp_path / "s"), optimizer=opt)
        pipe.save_checkpoint(str(tmp_path / "a"), optimizer=opt, async_save=True).result(60)
        pipe.load_checkpoint(str(tmp_path / "a"), optimizer=opt)
