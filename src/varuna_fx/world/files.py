"""The on-disk caches: where they live (one variable, ``$VARUNA_FX_CACHE_DIR``) and small files
written whole or not at all."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from . import switches

CACHE_ENV = "VARUNA_FX_CACHE_DIR"  # the root of every on-disk cache
# The profiles folder itself, as docs/API.md once documented it: still read, for profiles only,
# when $VARUNA_FX_CACHE_DIR is not set.
PROFILES_ALIAS_ENV = "VARUNA_FX_CACHE"


def cache_dir(kind: str) -> Path:
    """The folder of one cache (``"graphs"``: the shape pass's observations, ``"profiles"``:
    measured profiles): ``$VARUNA_FX_CACHE_DIR/<kind>``, default ``~/.cache/varuna_fx/<kind>``."""
    root = switches.read(CACHE_ENV)
    if root:
        return Path(root) / kind
    alias = switches.read(PROFILES_ALIAS_ENV) if kind == "profiles" else None
    return Path(alias) if alias else Path.home() / ".cache" / "varuna_fx" / kind


def write_atomically(directory: Path, name: str, text: str) -> None:
    """Write ``directory/name`` so a reader sees the old file or the whole new one: the text
    goes to a name no other writer uses (ranks, threads, machines sharing a home directory),
    then is renamed over ``name``. Creates ``directory``; raises ``OSError`` when it cannot."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, directory / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def keep_newest(directory: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest ``*.json`` entries of a cache folder (by mtime; a
    file another process removed meanwhile is skipped)."""
    entries = []
    for path in directory.glob("*.json"):
        try:
            entries.append((path.stat().st_mtime, path))
        except OSError:
            continue
    for _, path in sorted(entries, reverse=True)[keep:]:
        path.unlink(missing_ok=True)


def sealed(entry: dict[str, Any]) -> str:
    """``entry`` as JSON with a digest of its content, so that a file edited or corrupted
    after it was written is noticed by :func:`unsealed` (a cache must never serve something
    other than what was computed for its key)."""
    body = json.dumps(entry, sort_keys=True)
    return json.dumps({"sha256": hashlib.sha256(body.encode()).hexdigest(), "entry": entry})


def unsealed(text: str) -> dict[str, Any]:
    """The entry :func:`sealed` wrote; ``ValueError`` when the text is not such an entry or
    its content no longer matches its digest."""
    outer = json.loads(text)
    if not isinstance(outer, dict) or not isinstance(outer.get("entry"), dict):
        raise ValueError("not a sealed entry")
    body = json.dumps(outer["entry"], sort_keys=True)
    if hashlib.sha256(body.encode()).hexdigest() != outer.get("sha256"):
        raise ValueError("content does not match its digest: edited or corrupted")
    return outer["entry"]


def read_entry(kind: str, key: str, format: int) -> dict[str, Any] | None:  # noqa: A002
    """The entry :func:`write_entry` wrote under ``key`` in cache ``kind``; None when there is
    no such file; ``ValueError`` when the file is not such an entry (corrupt, edited, or
    written for another key or by another format)."""
    try:
        text = (cache_dir(kind) / f"{key}.json").read_text()
    except OSError:
        return None
    entry = unsealed(text)
    if entry.get("format") != format or entry.get("key") != key:
        raise ValueError("written for another key or by another format")
    return entry


def write_entry(kind: str, key: str, format: int, fields: dict[str, Any],  # noqa: A002
                keep: int) -> bool:
    """Write ``fields`` (JSON-able) as the sealed entry of ``key`` in cache ``kind``,
    atomically, keeping the newest ``keep`` entries; False when the folder cannot be written
    (a cache only saves time: the caller goes on)."""
    directory = cache_dir(kind)
    try:
        write_atomically(directory, f"{key}.json",
                         sealed({"format": format, "key": key, **fields}))
        keep_newest(directory, keep)
    except OSError:
        return False
    return True
