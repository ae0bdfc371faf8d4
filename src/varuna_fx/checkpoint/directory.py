"""A checkpoint on disk: the marker, the ``.partial`` protocol and finding the newest one.

DCP writes into ``<path>.partial``; when every rank is done, rank 0 writes the marker
(:data:`MARKER`) into it and renames the directory to ``<path>``. A kill at any moment leaves at
most a ``.partial`` directory, which :func:`latest_checkpoint` skips with a warning, and every
earlier checkpoint untouched.

* Order: the marker holds ``sequence``, one more than the largest among the checkpoints beside
  it when it completed. :func:`latest_checkpoint` orders by it (then by ``saved_at_ns``, for
  markers written before sequences), never by a clock alone: a restart on a machine whose clock
  is behind, or a marker dated in the future, cannot reorder saves. A marker it cannot read
  (not JSON, fields of the wrong type) is skipped with a warning naming it.
* One writer per path: rank 0 holds an exclusive ``flock`` on ``<path>.lock`` from preparing
  the save until the rename, so a second job saving to the same path fails at once with
  :class:`CheckpointError` instead of interleaving ``.partial``, rmtree and renames with the
  first. A killed holder's lock is released by the kernel; the lock file goes on unlock.
* A directory holding DCP's ``.metadata`` but no marker was written by a plain ``dcp.save``:
  it is not a varuna_fx checkpoint (its keys follow no known convention) and is skipped, or
  refused by ``load_checkpoint``, saying so.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..world import safe_json

# 4: raw bytes with a CRC-32 per entry bound to its name, shape, dtype and place; 3: a CRC-32
# of the bytes alone; 2: raw bytes (raw_storage.py); 1: DCP's torch.save records (all read)
FORMAT = 4
READABLE = (1, 2, 3, 4)
MARKER = "varuna_fx_checkpoint.json"
PARTIAL = ".partial"
LOCK = ".lock"
DCP_METADATA = ".metadata"
NO_LOCK = -1  # what lock() returns on a filesystem without flock


def latest_checkpoint(directory: str | os.PathLike) -> str | None:
    """The newest complete checkpoint directly under ``directory`` (by the sequence number its
    save recorded), or None. Directories a killed save left behind, plain DCP directories and
    unreadable markers are skipped with a warning."""
    found = checkpoints_newest_first(directory)
    return found[0] if found else None


def checkpoints_newest_first(directory: str | os.PathLike) -> list[str]:
    """Every complete checkpoint directly under ``directory``, newest first (the order of
    :func:`latest_checkpoint`, which skips what it skips): a resume whose newest checkpoint
    turns out damaged tries the next."""
    root = Path(directory)
    if not root.is_dir():
        return []
    complete: list[tuple[int, int, str]] = []
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        if entry.name.endswith(PARTIAL):
            warnings.warn(f"skipping incomplete checkpoint {entry} (its save was interrupted, "
                          "or is still running)", stacklevel=2)
            continue
        if not (entry / MARKER).exists():
            if (entry / DCP_METADATA).exists():
                warnings.warn(f"skipping {entry}: a torch.distributed.checkpoint directory "
                              f"without varuna_fx's {MARKER} (a plain dcp.save), not a "
                              "varuna_fx checkpoint", stacklevel=2)
            continue  # not a checkpoint
        try:
            marker = _parse_marker(entry / MARKER)
            complete.append((_order(marker), marker.get("saved_at_ns", 0), str(entry)))
        except CheckpointError as exc:
            warnings.warn(f"skipping {entry}: {exc}", stacklevel=2)
    return [path for *_, path in sorted(complete, reverse=True)]


def next_sequence(path: str) -> int:
    """One more than the largest sequence among the checkpoints beside ``path``."""
    parent = Path(os.path.abspath(path)).parent
    largest = 0
    for marker_file in parent.glob(f"*/{MARKER}"):
        try:
            largest = max(largest, _order(_parse_marker(marker_file)))
        except CheckpointError:
            continue  # latest_checkpoint warns about it
    return largest + 1


def _order(marker: dict[str, Any]) -> int:
    return marker.get("sequence", 0)  # written before sequences: before every newer one


def _parse_marker(marker_file: Path) -> dict[str, Any]:
    """A marker's JSON, its fields checked (:class:`CheckpointError` naming what is wrong)."""
    try:
        marker = safe_json.loads(marker_file.read_text())  # bounded: a crafted file nests deep
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{marker_file} is unreadable ({exc})") from exc
    if not isinstance(marker, dict):
        raise CheckpointError(f"{marker_file} holds a JSON {type(marker).__name__}, not an "
                              "object")
    for field, types in (("format", (int,)), ("sequence", (int,)), ("saved_at_ns", (int,)),
                         ("optimizer", (str, type(None))), ("byteorder", (str,))):
        if field in marker and type(marker[field]) not in types:  # bool, NaN, null: no
            raise CheckpointError(f"{marker_file}: {field} is {marker[field]!r}, not "
                                  f"{' or '.join(t.__name__ for t in types)}")
    if "format" not in marker:
        raise CheckpointError(f"{marker_file} has no format field")
    if marker["format"] not in READABLE:
        raise CheckpointError(f"{marker_file} has checkpoint format {marker['format']}; this "
                              f"varuna_fx reads formats {', '.join(map(str, READABLE))}")
    return marker


def read_marker(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a checkpoint: no such directory")
    if not os.path.exists(os.path.join(path, MARKER)):
        if path.endswith(PARTIAL):
            raise CheckpointError(f"{path} is an incomplete checkpoint (a save that was "
                                  "interrupted or is still running): load a complete one, "
                                  "e.g. vf.latest_checkpoint(dir)")
        if os.path.exists(os.path.join(path, DCP_METADATA)):
            raise CheckpointError(
                f"{path} is a plain torch.distributed.checkpoint directory (it has "
                f"{DCP_METADATA} but no {MARKER}), not a varuna_fx checkpoint: its keys follow "
                "no convention varuna_fx knows. Load it with torch.distributed.checkpoint.load "
                "into a state dict keyed like pipe.state_dict() and pass that to "
                "pipe.load_state_dict, or pass a directory pipe.save_checkpoint wrote")
        raise CheckpointError(
            f"{path} is not a complete varuna_fx checkpoint (no {MARKER}): pass a directory "
            "pipe.save_checkpoint wrote, e.g. vf.latest_checkpoint(dir)")
    marker = _parse_marker(Path(path) / MARKER)
    if marker["format"] >= 2 and marker.get("byteorder", sys.byteorder) != sys.byteorder:
        raise CheckpointError(f"{path} was written on a {marker['byteorder']}-endian machine; "
                              f"its raw tensor bytes cannot be read on this {sys.byteorder}-"
                              "endian one")
    return marker


def prepare(path: str) -> int:
    """Rank 0, before a save: take the path's lock (returned: pass it to :func:`unlock`); a
    stale ``.partial`` (a killed save: no one holds the lock) goes; the destination must be
    free or a checkpoint (which the new one replaces)."""
    if os.path.exists(path) and not os.path.exists(os.path.join(path, MARKER)):
        raise CheckpointError(f"{path} exists and is not a checkpoint: refusing to overwrite it")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = lock(path)
    try:
        if os.path.exists(path + PARTIAL):
            shutil.rmtree(path + PARTIAL)
    except BaseException:
        unlock(path, fd)
        raise
    return fd


def lock(path: str) -> int:
    """An exclusive lock on ``<path>.lock``, or :class:`CheckpointError` if another process
    holds it (never waits: two jobs saving to one path is a mistake to report)."""
    name = path + LOCK
    while True:
        fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                warnings.warn(f"the filesystem of {path} does not support flock: saving "
                              "without the lock that keeps a second job from saving to the "
                              "same path meanwhile", stacklevel=2)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name)
                return NO_LOCK
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise CheckpointError(
                f"another process is saving to {path} (it holds {name}): two jobs must not "
                "save into one directory. Give each job its own checkpoint directory, or wait "
                "until the other save is done") from None
        try:  # its last holder may have unlinked the file between our open and flock
            if os.fstat(fd).st_ino == os.stat(name).st_ino:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()} {os.uname().nodename}\n".encode())
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def unlock(path: str, fd: int) -> None:
    """Release :func:`lock` (the file goes first, while still held: see :func:`lock`)."""
    if fd == NO_LOCK:
        return
    try:
        os.unlink(path + LOCK)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


def discard(path: str) -> None:
    """Rank 0, after a save failed: its ``.partial`` goes, so it holds no disk space that
    later saves need (a full disk)."""
    shutil.rmtree(path + PARTIAL, ignore_errors=True)


def commit(path: str, marker: dict[str, Any]) -> None:
    """Rank 0, holding the lock: write the marker (with its sequence) and rename into place."""
    partial = path + PARTIAL
    marker = {**marker, "sequence": next_sequence(path)}
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
