"""Documents to tokenize: text files, JSON Lines files, and Hugging Face ``datasets`` on disk.

* A text file (``.txt``, ``.text``, ``.md``) is one document: its whole UTF-8 text.
* A JSON Lines file (``.jsonl``, ``.ndjson``) holds one JSON object per line, its document the
  string under ``text_key`` (``"text"`` by default: what most corpora on the Hub use); blank
  lines are skipped.
* A folder written by ``datasets``' ``save_to_disk``, or a ``.parquet`` file, read with the
  optional ``datasets`` package (``pip install varuna_fx[datasets]``): the column ``text_key``
  of its rows. Only local files: no hub, no loading script (which would run code).

What cannot be trained on is refused here, before a token is made, each ``InputError`` naming
the file and the line or row: a missing file, a line that is not a JSON object, a document that
is not a string, an empty document (an empty line's worth of text trains nothing and usually
means the wrong ``text_key``), or no documents at all.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..world import safe_json

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
DATASETS_SUFFIXES = (".parquet",)
DEFAULT_TEXT_KEY = "text"


def is_document_source(path: str | Path) -> bool:
    """Whether ``path`` names documents a tokenizer makes tokens of (not a token file)."""
    p = Path(path)
    return p.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES + DATASETS_SUFFIXES or \
        (p.is_dir() and is_saved_dataset(p))


def is_saved_dataset(folder: Path) -> bool:
    """A folder ``datasets.Dataset.save_to_disk`` wrote (its ``state.json`` beside the arrow
    files)."""
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def check_source(path: str | Path) -> Path:
    """``path`` as a Path, refused when it is not there."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"data = {str(path)!r} does not exist: give a text (.txt), JSON Lines "
                         "(.jsonl) or token (.bin) file, or a folder a datasets save_to_disk "
                         "wrote")
    if p.is_dir() and not is_saved_dataset(p):
        raise InputError(f"data = {str(path)!r} is a folder but not one datasets' save_to_disk "
                         "wrote (no state.json): give a file, or that folder")
    return p


def read_documents(path: str | Path, text_key: str = DEFAULT_TEXT_KEY) -> Iterator[str]:
    """The documents of ``path`` in order, each checked (see the module docstring)."""
    p = check_source(path)
    if p.suffix in JSONL_SUFFIXES:
        yield from _jsonl(p, text_key)
    elif p.is_dir() or p.suffix in DATASETS_SUFFIXES:
        yield from _datasets_rows(p, text_key)
    else:
        text = _decode(p.read_bytes(), p, None)
        if not text.strip():
            raise InputError(f"{p} is empty (or only whitespace): a text file is one document; "
                             "give a file with text in it")
        yield text


def _decode(raw: bytes, path: Path, line: int | None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = f"{path} line {line}" if line is not None else str(path)
        raise InputError(f"{where} is not UTF-8 text ({exc.reason} at byte {exc.start}): "
                         "convert it to UTF-8, or give it as a token (.bin) file") from None


def _jsonl(path: Path, text_key: str) -> Iterator[str]:
    found = False
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            line = _decode(raw, path, number).strip()
            if not line:
                continue
            try:
                # bounded in depth: a crafted line raises ValueError, never a RecursionError
                record = safe_json.loads(line)
            except (ValueError, json.JSONDecodeError) as exc:
                raise InputError(f"{path} line {number} is not JSON ({exc}): a .jsonl file "
                                 "holds one JSON object per line") from None
            yield _document(record, text_key, f"{path} line {number}")
            found = True
    if not found:
        raise InputError(f"{path} holds no documents (no non-blank line): give a .jsonl file "
                         f"of objects with a {text_key!r} field")


def _document(record: Any, text_key: str, where: str) -> str:
    if not isinstance(record, dict):
        raise InputError(f"{where} is a JSON {type(record).__name__}, not an object with a "
                         f"{text_key!r} field")
    if text_key not in record:
        keys = ", ".join(map(repr, list(record)[:8])) or "none"
        raise InputError(f"{where} has no {text_key!r} field (its keys: {keys}): give the "
                         "field holding the text with --text-key")
    text = record[text_key]
    if not isinstance(text, str):
        raise InputError(f"{where}: {text_key!r} is a {type(text).__name__}, not a string of "
                         "text: give the field holding the text with --text-key")
    if not text.strip():
        raise InputError(f"{where}: the document under {text_key!r} is empty: remove it from "
                         "the data, or give the field holding the text with --text-key")
    return text


def _datasets_rows(path: Path, text_key: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise InputError(f"{path} is read with Hugging Face datasets, which is not installed: "
                         "pip install varuna_fx[datasets] (or give a .txt / .jsonl file)") from None
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise InputError(f"{path} holds the splits {sorted(loaded)}, none named train: "
                                 "give the folder of one split")
            loaded = loaded["train"]
    else:  # the packaged parquet reader: a local file, no loading script
        loaded = datasets.load_dataset("parquet", data_files=str(path), split="train")
    if text_key not in loaded.column_names:
        raise InputError(f"{path} has no column {text_key!r} (its columns: "
                         f"{', '.join(loaded.column_names)}): give it with --text-key")
    if len(loaded) == 0:
        raise InputError(f"{path} holds no rows: nothing to train on")
    for row, text in enumerate(loaded[text_key]):
        yield _document({text_key: text}, text_key, f"{path} row {row}")
