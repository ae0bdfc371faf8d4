"""The data of ``varuna-fx train``: a token file, a text file's bytes, documents tokenized with
a local tokenizer (``--tokenizer DIR``: text, JSON Lines, datasets on disk; ``data/tokenize.py``
caches their tokens), or the built-in corpus.

The built-in corpus needs no download: the Python standard library's own sources read as bytes
(a vocabulary of 256). It is deterministic on one Python version: every ``*.py`` file under
the standard library's directory (``sysconfig``'s "stdlib" path; installed packages excluded),
in sorted order of their relative paths, each followed by a newline, cut at ``corpus_bytes``.
Its digest is printed at the start, so two runs can tell they read the same bytes.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..data.tokenize import TokenFile, tokenized
from ..data.tokens import TOKEN_SUFFIXES, TokenDataset, refuse_negative
from ..errors import InputError
from .config import AUTO, STDLIB_CORPUS, TrainConfig

BYTE_VOCAB = 256
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}  # installed packages; bytecode


@dataclass(frozen=True)
class TrainData:
    dataset: TokenDataset
    vocab_size: int | None  # what the source fixes (256 for bytes), else None
    largest_token: int  # the largest id in it: the model's vocabulary must exceed it
    description: str
    # a tokenizer's vocabulary: every id it can make must have a row in the model's
    # embedding, not only those this data holds (None: no tokenizer)
    tokenizer_vocab: int | None = None


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's sources in the corpus's order."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    found: list[tuple[str, Path]] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS]  # not walked at all
        here = Path(folder)
        relative = here.relative_to(root).as_posix()
        found += [(name if relative == "." else f"{relative}/{name}", here / name)
                  for name in names if name.endswith(".py")]
    return [path for _, path in sorted(found)]


def stdlib_corpus(size: int, root: Path | None = None) -> np.ndarray:
    """``size`` bytes of the standard library's sources (fewer if it is smaller), as uint8."""
    chunks, total = [], 0
    for path in stdlib_files(root):
        if total >= size:
            break
        data = path.read_bytes() + b"\n"
        chunks.append(data)
        total += len(data)
    if not chunks:
        raise InputError(f"no Python sources under {sysconfig.get_paths()['stdlib']} to train "
                         "on (an embedded Python?): give a text or token file with --data")
    return np.frombuffer(b"".join(chunks)[:size], dtype=np.uint8)


def open_data(cfg: TrainConfig) -> TrainData:
    """The dataset the configuration names, with what the model must fit."""
    if cfg.data == STDLIB_CORPUS:
        corpus = stdlib_corpus(cfg.corpus_bytes)
        digest = hashlib.sha256(corpus.tobytes()).hexdigest()[:12]
        dataset = TokenDataset(corpus, cfg.seq_len)
        return TrainData(dataset, BYTE_VOCAB, int(corpus.max()),
                         f"the Python standard library's sources, {len(corpus):,} bytes "
                         f"(sha256 {digest}), {len(dataset):,} samples of {cfg.seq_len}")
    if cfg.tokenizer:
        return _tokenized_data(cfg, prepare_data(cfg, progress=False))
    dtype = None if cfg.data_dtype == AUTO else cfg.data_dtype
    dataset = TokenDataset(cfg.data, cfg.seq_len, dtype=dtype)
    tokens: Any = dataset.tokens
    # one pass over the (memory-mapped) file: a token beyond the model's vocabulary, or a
    # negative one (a signed file: Megatron's int32), would otherwise fail inside the
    # embedding mid-step, as an index error from torch
    refuse_negative(tokens, cfg.data)
    largest = int(np.max(tokens))
    kind = "bytes" if dataset.vocab_size == BYTE_VOCAB else \
        f"{np.dtype(tokens.dtype).name} tokens"
    if Path(cfg.data).suffix not in TOKEN_SUFFIXES:
        kind = "bytes (text)"
    return TrainData(dataset, dataset.vocab_size, largest,
                     f"{cfg.data}: {len(tokens):,} {kind}, {len(dataset):,} samples of "
                     f"{cfg.seq_len}")


def prepare_data(cfg: TrainConfig, *, progress: bool = True) -> TokenFile | None:
    """The run's documents tokenized (once: later calls, and the ranks, find them cached), with
    the checks that need the tokenizer, before anything is launched; None without a
    tokenizer."""
    if not cfg.tokenizer:
        return None
    made = tokenized(cfg.data, cfg.tokenizer, cfg.text_key, progress=progress)
    if cfg.vocab_size != AUTO and made.vocab_size > cfg.vocab_size:
        raise InputError(f"the tokenizer {cfg.tokenizer} has a vocabulary of "
                         f"{made.vocab_size:,}, more than vocab_size = {cfg.vocab_size:,}: "
                         f"give --vocab-size {made.vocab_size} or more (or auto)")
    return made


def _tokenized_data(cfg: TrainConfig, made: TokenFile | None) -> TrainData:
    assert made is not None
    dataset = TokenDataset(made.path, cfg.seq_len, dtype=made.dtype)
    largest = int(np.max(dataset.tokens))
    return TrainData(dataset, made.vocab_size, largest,
                     f"{cfg.data}: {made.documents:,} documents, {made.count:,} tokens of "
                     f"{cfg.tokenizer} (vocabulary {made.vocab_size:,}), {len(dataset):,} "
                     f"samples of {cfg.seq_len}{' (cached)' if made.cached else ''}",
                     tokenizer_vocab=made.vocab_size)
