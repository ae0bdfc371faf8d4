"""Documents made tokens once: a local Hugging Face tokenizer, and a memory-mapped token file
in the cache.

``tokenized(source, tokenizer_dir, text_key)`` returns a :class:`TokenFile`: a ``.bin`` of
uint16 (a vocabulary of at most 65,536) or uint32 tokens, the documents in order, each followed
by the tokenizer's end-of-text token where it has one (``eos_token`` of its
tokenizer_config.json), so a window that crosses documents sees where one ends. It lives in
``$VARUNA_FX_CACHE_DIR/tokens/`` (``world/files.cache_dir``), keyed by what the tokens depend
on: the tokenizer's files (their SHA-256), each data file's size, mtime and SHA-256, the text
key and this code (``world/disk_cache``). ``seq_len`` is not in the key: the file is the token
stream, and ``TokenDataset`` cuts windows of any length from it, so another ``seq_len`` reuses
it. The second run, and every rank of a run, memory-maps it.

The tokenizer is read from a folder only, never a hub: its ``tokenizer.json`` with
``tokenizers.Tokenizer.from_file`` (a JSON file: nothing in it runs), or without one
transformers' ``AutoTokenizer.from_pretrained(folder, local_files_only=True)`` (never
``trust_remote_code``). A cached file is used only when its sealed entry names it, its size is
``count`` tokens and its SHA-256 is the one written; anything else is tokenized again.

While tokenizing, a rich progress bar (on a terminal) counts the input's bytes.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from ..world import disk_cache, safe_json
from ..world.files import cache_dir
from .documents import check_source, is_saved_dataset, read_documents

KIND = "tokens"
FORMAT = 1
_KEEP = 8  # token files kept in the cache (the newest)
_BATCH = 256  # documents per encode_batch
_CHUNK = 1 << 20
CACHE = disk_cache.DiskCache[dict[str, Any]](KIND, FORMAT, _KEEP, family=KIND)


@dataclass(frozen=True)
class TokenFile:
    path: Path
    dtype: str  # "uint16" | "uint32"
    count: int  # tokens
    documents: int
    vocab_size: int  # the tokenizer's: every id it makes is below it
    cached: bool  # found in the cache (False: tokenized now)


class LocalTokenizer:
    """A tokenizer read from a local folder: ``encode_batch``, ``vocab_size``, ``eos_id``."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise InputError(f"tokenizer = {str(folder)!r} is not a folder: give the folder "
                             "holding tokenizer.json (a Hugging Face model's or tokenizer's)")
        self._config = _read_config(self.folder / "tokenizer_config.json")
        fast = self.folder / "tokenizer.json"
        self._fast: Any = None
        self._auto: Any = None
        if fast.is_file():
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise InputError(f"{fast} is read with Hugging Face tokenizers, which is not "
                                 "installed: pip install varuna_fx[text]") from None
            try:
                self._fast = Tokenizer.from_file(str(fast))
            except Exception as exc:  # the Rust parser's error, whatever its type
                raise InputError(f"{fast} is not a tokenizer tokenizers reads: {exc}") from None
            self.vocab_size = int(self._fast.get_vocab_size(with_added_tokens=True))
        else:
            self._auto = _auto_tokenizer(self.folder)
            self.vocab_size = int(len(self._auto))
        self.eos_id = self._eos_id()

    def _eos_id(self) -> int | None:
        eos = self._config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if self._auto is not None:
            return self._auto.eos_token_id
        return self._fast.token_to_id(eos) if isinstance(eos, str) else None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(texts, add_special_tokens=False)]
        return self._auto(texts, add_special_tokens=False)["input_ids"]

    def digest(self) -> str:
        """SHA-256 over the folder's tokenizer files (what the tokens depend on)."""
        h = hashlib.sha256()
        for path in sorted(self.folder.iterdir()):
            if path.is_file() and (path.name.startswith(("tokenizer", "special_tokens")) or
                                   path.suffix in (".model", ".txt", ".json") and
                                   path.name != "config.json"):
                h.update(path.name.encode() + b"\0")
                h.update(_file_digest(path).encode())
        return h.hexdigest()


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        found = safe_json.loads(path.read_bytes())
    except ValueError as exc:
        raise InputError(f"{path} is not JSON: {exc}") from None
    return found if isinstance(found, dict) else {}


# what a tokenizer without tokenizer.json keeps its vocabulary in (SentencePiece, WordPiece,
# BPE): without one, AutoTokenizer makes a tokenizer of its special tokens alone, silently
_VOCABULARY_FILES = ("*.model", "vocab.txt", "vocab.json", "merges.txt")


def _auto_tokenizer(folder: Path) -> Any:
    if not any(next(folder.glob(pattern), None) for pattern in _VOCABULARY_FILES):
        raise InputError(f"{folder} holds no tokenizer.json and no vocabulary file "
                         f"({', '.join(_VOCABULARY_FILES)}): give the folder a Hugging Face "
                         "tokenizer was saved to (tokenizer.save_pretrained(DIR))")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise InputError(f"{folder} has no tokenizer.json, and reading another tokenizer needs "
                         "transformers: pip install transformers") from None
    try:  # files only; never code from the folder
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                             trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"{folder} holds no tokenizer transformers reads from files "
                         f"(tokenizer.json, or a tokenizer.model with its config): {exc}") from None


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def data_files(source: Path) -> list[Path]:
    """The files whose bytes the documents come from (a saved dataset: its folder's)."""
    if source.is_dir():
        return sorted(p for p in source.rglob("*") if p.is_file())
    return [source]


def cache_key(source: Path, tokenizer: LocalTokenizer, text_key: str) -> str:
    files = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns, _file_digest(p))
             for p in data_files(source)]
    return CACHE.key(repr((files, tokenizer.digest(), text_key, is_saved_dataset(source))))


def tokenized(source: str | Path, tokenizer_dir: str | Path, text_key: str, *,
              progress: bool = True) -> TokenFile:
    """The tokens of ``source``'s documents (see the module docstring): from the cache when
    this exact input was tokenized before, else tokenized now and cached."""
    path = check_source(source)
    tokenizer = LocalTokenizer(tokenizer_dir)
    key = cache_key(path, tokenizer, text_key)
    found = CACHE.load(key, lambda entry: _checked(entry, key))
    if found is not None:
        return TokenFile(Path(found["path"]), found["dtype"], found["count"],
                         found["documents"], found["vocab_size"], cached=True)
    made = _tokenize(path, tokenizer, text_key, key, progress)
    stored = CACHE.store(
        key, {"path": str(made.path), "dtype": made.dtype, "count": made.count,
              "documents": made.documents, "vocab_size": made.vocab_size},
        {"dtype": made.dtype, "count": made.count, "documents": made.documents,
         "vocab_size": made.vocab_size, "sha256": _file_digest(made.path)})
    if stored:  # (the cache off: the file stays, unentered, for this run to read)
        _drop_orphans(made.path.parent)
    return made


def _checked(entry: dict[str, Any], key: str) -> dict[str, Any]:
    """A cache entry's token file, checked against what was written (ValueError: it is made
    again)."""
    path = cache_dir(KIND) / f"{key}.bin"
    dtype, count = entry["dtype"], entry["count"]
    if dtype not in ("uint16", "uint32") or not isinstance(count, int) or count < 1:
        raise ValueError("its dtype or count is not one this code writes")
    if not path.is_file() or path.stat().st_size != count * np.dtype(dtype).itemsize:
        raise ValueError(f"{path.name} is missing or not {count} {dtype} tokens")
    if _file_digest(path) != entry["sha256"]:
        raise ValueError(f"{path.name} is not the file written (SHA-256 differs)")
    return {"path": str(path), "dtype": dtype, "count": count,
            "documents": int(entry["documents"]), "vocab_size": int(entry["vocab_size"])}


def _batches(path: Path, text_key: str) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in read_documents(path, text_key):
        batch.append(text)
        if len(batch) == _BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _tokenize(path: Path, tokenizer: LocalTokenizer, text_key: str, key: str,
              progress: bool) -> TokenFile:
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    folder = cache_dir(KIND)
    folder.mkdir(parents=True, exist_ok=True)
    total = sum(p.stat().st_size for p in data_files(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=folder)
    count = documents = 0
    try:
        with os.fdopen(fd, "wb") as out, _Bar(f"tokenizing {path.name}", total, progress) as bar:
            for batch in _batches(path, text_key):
                ids = tokenizer.encode_batch(batch)
                for one in ids:
                    if tokenizer.eos_id is not None:
                        one = [*one, tokenizer.eos_id]
                    np.asarray(one, dtype=dtype).tofile(out)
                    count += len(one)
                documents += len(batch)
                bar.advance(sum(len(t.encode()) for t in batch), documents, count)
        if count < 2:
            raise InputError(f"{path}: its {documents} document(s) make {count} token(s) with "
                             f"{tokenizer.folder}: too few to train on")
        final = folder / f"{key}.bin"
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return TokenFile(final, np.dtype(dtype).name, count, documents, tokenizer.vocab_size,
                     cached=False)


def _drop_orphans(folder: Path) -> None:
    """Token files whose entry the cache dropped (it keeps the newest ``_KEEP`` entries)."""
    for path in folder.glob("*.bin"):
        if not path.with_suffix(".json").exists():
            path.unlink(missing_ok=True)


class _Bar:
    """A rich progress bar over the input's bytes on a terminal; silent elsewhere."""

    def __init__(self, what: str, total: int, enabled: bool) -> None:
        self.what, self.total, self.enabled = what, total, enabled
        self._progress: Any = None

    def __enter__(self) -> _Bar:
        import sys

        if self.enabled and sys.stderr.isatty():
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                      DownloadColumn(), TimeRemainingColumn(),
                                      TextColumn("{task.fields[note]}"), transient=True)
            self._progress.start()
            self._task = self._progress.add_task(self.what, total=self.total, note="")
        return self

    def advance(self, nbytes: int, documents: int, tokens: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=nbytes,
                                  note=f"{documents:,} documents, {tokens:,} tokens")

    def __exit__(self, *_: Any) -> None:
        if self._progress is not None:
            # (the bar counts the documents' bytes, a little less than a .jsonl file's)
            self._progress.update(self._task, completed=self.total)
            self._progress.stop()
