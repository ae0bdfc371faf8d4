"""Text and JSON Lines data tokenized by a local Hugging Face tokenizer (issue 44 item 2):
tokens as the tokenizer makes them, each document ended by its end-of-text token, cached once
as a memory-mapped token file keyed by the tokenizer and the files, and every bad input (a
missing file, an empty document, a tokenizer larger than the model) refused before training.
The tokenizer is built here, from a few lines: nothing is downloaded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import varuna_fx as vf
from varuna_fx.data import tokenize
from varuna_fx.data.documents import read_documents
from varuna_fx.data.tokenize import LocalTokenizer, tokenized
from varuna_fx.train.checks import resolve
from varuna_fx.train.config import TrainConfig
from varuna_fx.train.data import open_data, prepare_data

LINES = ["the cat sat on the mat", "a dog sat on a log", "the end of the story"]


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(LINES, trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return folder


def _jsonl(path: Path, docs: list[object]) -> Path:
    path.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    return path


def test_jsonl_documents_become_the_tokenizers_ids_each_ended_by_eos_and_cached_once(
        tmp_path: Path, tokenizer_dir: Path) -> None:
    data = _jsonl(tmp_path / "docs.jsonl", [{"text": t, "id": i} for i, t in enumerate(LINES)])
    tok = LocalTokenizer(tokenizer_dir)
    eos = tok.eos_id
    assert eos is not None
    expected = [i for ids in tok.encode_batch(LINES) for i in [*ids, eos]]
    first = tokenized(data, tokenizer_dir, "text", progress=False)
    assert (first.cached, first.documents, first.dtype) == (False, 3, "uint16")
    assert np.fromfile(first.path, dtype=np.uint16).tolist() == expected
    again = tokenized(data, tokenizer_dir, "text", progress=False)
    assert again.cached and again.path == first.path  # the second run memory-maps it
    data.write_text(data.read_text() + json.dumps({"text": "the cat"}) + "\n")
    changed = tokenized(data, tokenizer_dir, "text", progress=False)
    assert not changed.cached and changed.documents == 4  # another file: another key
    ds = vf.TokenDataset(changed.path, 4, dtype=changed.dtype)
    x, y = ds[0]
    torch.testing.assert_close(x[1:], y[:-1])


def test_a_damaged_cached_token_file_is_made_again(tmp_path: Path, tokenizer_dir: Path) -> None:
    data = tmp_path / "corpus.txt"
    data.write_text("\n".join(LINES))
    made = tokenized(data, tokenizer_dir, "text", progress=False)
    with open(made.path, "r+b") as f:  # same size, other bytes
        f.write(b"\xff\xff")
    with pytest.warns(vf.world.disk_cache.CacheWarning, match="SHA-256"):
        again = tokenized(data, tokenizer_dir, "text", progress=False)
    assert not again.cached
    assert np.fromfile(again.path, dtype=np.uint16)[0] != 0xFFFF


def test_the_train_command_reads_jsonl_with_a_text_key_and_checks_the_vocabulary(
        tmp_path: Path, tokenizer_dir: Path) -> None:
    data = _jsonl(tmp_path / "docs.jsonl", [{"body": t} for t in LINES * 4])
    cfg, _ = resolve(["--data", str(data), "--tokenizer", str(tokenizer_dir), "--text-key",
                      "body", "--seq-len", "4"])
    opened = open_data(cfg)
    assert opened.vocab_size == opened.tokenizer_vocab == LocalTokenizer(tokenizer_dir).vocab_size
    assert "12 documents" in opened.description and len(opened.dataset) > 0
    small = TrainConfig(data=str(data), tokenizer=str(tokenizer_dir), text_key="body",
                        vocab_size=4)
    with pytest.raises(vf.InputError, match=r"vocabulary of \d+, more than vocab_size = 4"):
        prepare_data(small)
    from varuna_fx.train.model import build_model  # a model smaller than the tokenizer

    with pytest.raises(vf.InputError, match="the model's embedding has 4 rows"):
        build_model(TrainConfig(vocab_size=4, tokenizer=str(tokenizer_dir)), 4, 2,
                    initialise=False, tokenizer_vocab=opened.tokenizer_vocab)


@pytest.mark.parametrize("lines, words", [
    ([{"text": "the cat"}, {"text": "  "}], ["line 2", "empty"]),
    ([{"text": "the cat"}, {"body": "x"}], ["line 2", "no 'text' field", "'body'", "--text-key"]),
    ([{"text": 3}], ["line 1", "int, not a string"]),
    (["the cat"], ["line 1", "str, not an object"]),
])
def test_bad_documents_are_refused_naming_the_line(tmp_path: Path, lines: list,
                                                   words: list[str]) -> None:
    data = _jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(vf.InputError) as caught:
        list(read_documents(data))
    for word in words:
        assert word in str(caught.value)


def test_missing_and_empty_inputs_are_refused_before_training(tmp_path: Path,
                                                             tokenizer_dir: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    with pytest.raises(vf.InputError, match="empty"):
        tokenized(empty, tokenizer_dir, "text", progress=False)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(vf.InputError, match="no documents"):
        list(read_documents(blank))
    (tmp_path / "notjson.jsonl").write_text("{oops\n")
    with pytest.raises(vf.InputError, match="line 1 is not JSON"):
        list(read_documents(tmp_path / "notjson.jsonl"))
    with pytest.raises(vf.InputError, match="does not exist"):
        list(read_documents(tmp_path / "gone.jsonl"))
    (tmp_path / "config_only").mkdir()  # AutoTokenizer would make one of special tokens only
    (tmp_path / "config_only" / "tokenizer_config.json").write_text("{}")
    with pytest.raises(vf.InputError, match="no tokenizer.json and no vocabulary file"):
        LocalTokenizer(tmp_path / "config_only")
    with pytest.raises(vf.InputError, match="is not a folder"):
        resolve(["--data", str(empty), "--tokenizer", str(tmp_path / "no_tok")])
    with pytest.raises(vf.InputError, match="is not a file"):
        resolve(["--data", str(tmp_path / "gone.jsonl"), "--tokenizer", str(tokenizer_dir)])
    docs = _jsonl(tmp_path / "docs.jsonl", [{"text": "a b"}])
    with pytest.raises(vf.InputError, match="--tokenizer DIR"):
        resolve(["--data", str(docs)])
    with pytest.raises(vf.InputError, match="already tokens"):
        resolve(["--tokenizer", str(tokenizer_dir)])  # the built-in corpus is bytes


def test_a_datasets_folder_is_read_when_the_extra_is_installed(tmp_path: Path,
                                                               tokenizer_dir: Path) -> None:
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": LINES}).save_to_disk(str(folder))
    assert list(read_documents(folder)) == LINES
    made = tokenized(folder, tokenizer_dir, "text", progress=False)
    assert made.documents == 3


def test_the_cache_lives_under_the_cache_dir(tmp_path: Path, tokenizer_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VARUNA_FX_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "corpus.txt"
    data.write_text(LINES[0])
    made = tokenized(data, tokenizer_dir, "text", progress=False)
    assert made.path.parent == tmp_path / "cache" / tokenize.KIND
    assert sorted(p.suffix for p in made.path.parent.iterdir()) == [".bin", ".json"]
    assert os.path.getsize(made.path) == made.count * 2
