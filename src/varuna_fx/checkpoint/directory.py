"""A checkpoint on disk: the marker, the ``.partial`` protocol and finding the newest one.

DCP writes into ``<path>.partial``; when every rank is done, rank 0 writes the marker
(:data:`MARKER`) into it and renames the directory to ``<path>``. A kill at any moment leaves at
most a ``.partial`` directory, which :func:`latest_checkpoint` skips with a warning, and every
earlier checkpoint untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

# 2: tensors stored as raw bytes (raw_storage.py); 1: DCP's torch.save records (still read)
FORMAT = 2
READABLE = (1, 2)
MARKER = "varuna_fx_checkpoint.json"
PARTIAL = ".partial"


def latest_checkpoint(directory: str | os.PathLike) -> str | None:
    """The newest complete checkpoint directly under ``directory`` (by the time it completed),
    or None. Directories a killed save left behind are skipped with a warning."""
    root = Path(directory)
    if not root.is_dir():
        return None
    complete: list[tuple[int, str]] = []
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        if entry.name.endswith(PARTIAL) or (
                not (entry / MARKER).exists() and (entry / ".metadata").exists()):
            warnings.warn(f"skipping incomplete checkpoint {entry} (its save was interrupted)",
                          stacklevel=2)
            continue
        try:
            marker = json.loads((entry / MARKER).read_text())
        except (OSError, ValueError):
            continue  # not a checkpoint
        complete.append((int(marker.get("saved_at_ns", 0)), str(entry)))
    return max(complete)[1] if complete else None


def read_marker(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a checkpoint: no such directory")
    try:
        with open(os.path.join(path, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is not a complete varuna_fx checkpoint (no valid {MARKER}): pass a "
            "directory pipe.save_checkpoint wrote, e.g. vf.latest_checkpoint(dir)"
        ) from exc
    if marker.get("format") not in READABLE:
        raise CheckpointError(f"{path} has checkpoint format {marker.get('format')}; this "
                              f"varuna_fx reads formats {', '.join(map(str, READABLE))}")
    if marker["format"] == 2 and marker.get("byteorder", sys.byteorder) != sys.byteorder:
        raise CheckpointError(f"{path} was written on a {marker['byteorder']}-endian machine; "
                              f"its raw tensor bytes cannot be read on this {sys.byteorder}-"
                              "endian one")
    return marker


def prepare(path: str) -> None:
    """Rank 0, before a save: a stale ``.partial`` (a killed save) goes; the destination must
    be free or a checkpoint (which the new one replaces)."""
    if os.path.exists(path) and not os.path.exists(os.path.join(path, MARKER)):
        raise CheckpointError(f"{path} exists and is not a checkpoint: refusing to overwrite it")
    if os.path.exists(path + PARTIAL):
        shutil.rmtree(path + PARTIAL)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def commit(path: str, marker: dict[str, Any]) -> None:
    partial = path + PARTIAL
    with open(os.path.join(partial, MARKER), "w") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    old = None
    if os.path.exists(path):  # replacing a checkpoint: never leave neither in place
        old = f"{path}.old-{os.getpid()}"
        os.rename(path, old)
    os.rename(partial, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
