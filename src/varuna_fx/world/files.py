"""The on-disk caches: where they live (one variable, ``$VARUNA_FX_CACHE_DIR``) and small files
written whole or not at all. What an entry holds and when it is trusted is the cache service's
(``disk_cache.py``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

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
