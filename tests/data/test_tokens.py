"""vf.TokenDataset: next-token windows over token files (uint16/uint32, nanoGPT and Megatron
layouts), text read as bytes, tensors and arrays; the dtype inference and every refusal."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import varuna_fx as vf
from varuna_fx import InputError
from varuna_fx.data.loader import GlobalBatchLoader


def check_windows(ds: vf.TokenDataset, tokens: np.ndarray, seq_len: int) -> None:
    assert len(ds) == (len(tokens) - 1) // seq_len
    for i in (0, 1, len(ds) - 1):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (seq_len,)
        assert x.tolist() == tokens[i * seq_len:(i + 1) * seq_len].tolist()
        assert y.tolist() == tokens[i * seq_len + 1:(i + 1) * seq_len + 1].tolist()


@pytest.mark.parametrize("kind, vocab", [(np.uint16, 50257), (np.uint32, 50257),
                                         (np.uint32, 200_000), (np.uint16, 65)])
def test_token_files_by_their_inferred_dtype(tmp_path: Path, kind: type, vocab: int) -> None:
    tokens = np.random.default_rng(0).integers(0, vocab, 4096).astype(kind)
    tokens.tofile(tmp_path / "train.bin")  # as nanoGPT's prepare.py writes it
    ds = vf.TokenDataset(tmp_path / "train.bin", 16)
    assert ds.tokens.dtype == kind and isinstance(ds.tokens, np.memmap)
    check_windows(ds, tokens, 16)
    again = pickle.loads(pickle.dumps(ds))  # a spawned worker reopens the file
    assert isinstance(again.tokens, np.memmap) and again[3][0].tolist() == ds[3][0].tolist()


def test_an_odd_size_is_uint16_and_a_megatron_index_names_the_dtype(tmp_path: Path) -> None:
    odd = np.arange(4097, dtype=np.uint16)
    odd.tofile(tmp_path / "odd.bin")
    assert vf.TokenDataset(tmp_path / "odd.bin", 8).tokens.dtype == np.uint16
    small = np.arange(100, dtype=np.uint32)  # 100 words: as uint32 they look like uint32 ...
    small.astype(np.uint16).tofile(tmp_path / "mega.bin")  # ... but the index says uint16
    with open(tmp_path / "mega.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8))
    assert vf.TokenDataset(tmp_path / "mega.bin", 8).tokens.dtype == np.uint16


def test_text_is_read_as_bytes_and_tensors_and_arrays_work(tmp_path: Path) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 10
    (tmp_path / "corpus.txt").write_text(text)
    ds = vf.TokenDataset(tmp_path / "corpus.txt", 32)
    assert ds.vocab_size == 256
    check_windows(ds, np.frombuffer(text.encode(), dtype=np.uint8), 32)
    ids = torch.arange(300) % 97
    check_windows(vf.TokenDataset(ids, 10), ids.numpy(), 10)
    check_windows(vf.TokenDataset(ids.numpy().astype(np.int32), 10), ids.numpy(), 10)
    strided = vf.TokenDataset(ids, 10, stride=5)
    assert len(strided) == (300 - 11) // 5 + 1 and strided[1][0].tolist() == ids[5:15].tolist()
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_a_loader_over_tokens_yields_input_and_target_batches(tmp_path: Path) -> None:
    ids = torch.arange(1000) % 251
    loader = GlobalBatchLoader(vf.TokenDataset(ids, 16), global_batch_size=6,
                                       replica=1, replicas=3, seed=0)
    x, y = next(iter(loader))
    assert x.shape == y.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])


def refuse(tmp_path: Path, case: str) -> None:
    if case == "too long":
        vf.TokenDataset(torch.arange(10), 10)
    elif case == "float":
        vf.TokenDataset(torch.rand(100), 4)
    elif case == "2-d":
        vf.TokenDataset(torch.zeros(4, 100, dtype=torch.long), 4)
    elif case == "missing":
        vf.TokenDataset(tmp_path / "nope.bin", 4)
    elif case == "empty":
        (tmp_path / "e.bin").write_bytes(b"")
        vf.TokenDataset(tmp_path / "e.bin", 4)
    elif case == "ambiguous":
        np.arange(8, dtype=np.uint32).tofile(tmp_path / "tiny.bin")
        vf.TokenDataset(tmp_path / "tiny.bin", 4)
    elif case == "partial token":
        (tmp_path / "p.bin").write_bytes(b"\x00" * 10)
        vf.TokenDataset(tmp_path / "p.bin", 1, dtype="uint32")
    elif case == "dtype":
        vf.TokenDataset(torch.arange(100), 4, dtype="int64")
    elif case == "seq_len":
        vf.TokenDataset(torch.arange(100), 0)
    elif case == "source":
        vf.TokenDataset([1, 2, 3], 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("case, match", [
    ("too long", "too long"), ("float", "1-D integer"), ("2-d", "1-D integer"),
    ("missing", "not a file"), ("empty", "empty"), ("ambiguous", "dtype='uint16'"),
    ("partial token", "whole number"), ("dtype", "dtype must be one of"),
    ("seq_len", "seq_len must be"), ("source", "a path, a tensor"),
])
def test_refusals(tmp_path: Path, case: str, match: str) -> None:
    with pytest.raises(InputError, match=match):
        refuse(tmp_path, case)


def test_negative_token_ids_are_refused_before_any_step(tmp_path: Path) -> None:
    """(issue 42, item 6) a negative id reached the embedding mid-step as torch's IndexError:
    an in-memory source is refused when made; a signed token file (Megatron's int32) when a
    window holding one is read, naming the sample and the token's place."""
    ids = torch.arange(200) % 50
    ids[57] = -1
    with pytest.raises(InputError, match=r"negative token id -1 at position 57"):
        vf.TokenDataset(ids, 10)
    with pytest.raises(InputError, match="negative token id -3"):
        vf.TokenDataset(np.array([1, 2, -3, 4, 5]), 2)
    tokens = np.arange(400, dtype=np.int32) % 50
    tokens[123] = -7
    tokens.tofile(tmp_path / "mega.bin")
    with open(tmp_path / "mega.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 4))
    ds = vf.TokenDataset(tmp_path / "mega.bin", 10)
    assert ds[0][0].tolist() == tokens[:10].tolist()
    with pytest.raises(InputError, match=r"sample 12 .* negative token id -7 at position 123"):
        ds[12]
