"""Captured graphs kept on disk, so a restarted or joining process of a job does not capture.

An entry is the graph ``graph_json`` writes, under the key ``model_key.capture_key`` takes from
the model before tracing (its code, state and example inputs). It also lists every source file
the process had loaded when it captured, outside Python's and torch's own (their versions are in
the key), with its size and modification time: an entry is used only while all of them are
unchanged, so an edit to code the key's walk does not reach (a function found through a dict, a
class's methods called from outside the model) still makes a fresh capture.

Files: ``$VARUNA_FX_CACHE_DIR/captures/<key>.json`` (default ``~/.cache/varuna_fx/captures``),
sealed with a digest of their content, written to a temporary name and renamed, at most
:data:`MAX_ENTRIES` kept. Loading runs no code (``graph_json``). An unreadable, corrupt,
stale or mismatching entry is ignored and rewritten, never an error. ``VARUNA_FX_GRAPH_CACHE=0``
turns it off, with the shape pass's cache.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..world import switches
from ..world.files import read_entry, write_entry
from .captured import Captured
from .graph_json import Unwritable, decode_captured, encode_captured
from .inputs import BoundInputs

FORMAT = 1
MAX_ENTRIES = 16
# what happened in this process (tests and benchmarks read it): hit, miss, write, unwritable,
# stale (a source file changed since), ignored (a file that could not be used)
stats: Counter[str] = Counter()


def enabled() -> bool:
    """Whether the graph caches (this one and the shape pass's) are on."""
    return switches.read("VARUNA_FX_GRAPH_CACHE") == "on"


def load(key: str, model: nn.Module, bound: BoundInputs) -> Captured | None:
    """The capture stored under ``key``, bound to ``model``; None when there is none usable."""
    try:
        entry = read_entry("captures", key, FORMAT)
        if entry is not None and not _unchanged(entry["files"]):
            stats["stale"] += 1
            entry = None
        captured = decode_captured(entry["captured"], model, bound) if entry else None
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError):
        stats["ignored"] += 1
        captured = None
    stats["hit" if captured is not None else "miss"] += 1
    return captured


def store(key: str, captured: Captured, model: nn.Module) -> None:
    """Write ``captured`` under ``key`` (a graph that cannot be written is skipped: it only
    saves time, as does a cache folder that cannot be written)."""
    try:
        data = encode_captured(captured, model)
    except Unwritable:
        stats["unwritable"] += 1
        return
    if write_entry("captures", key, FORMAT, {"files": loaded_files(), "captured": data},
                   MAX_ENTRIES):
        stats["write"] += 1


def loaded_files() -> list[list[Any]]:
    """[path, size, mtime_ns] of every source file of an imported module, but Python's own
    and torch's (their versions are in the key)."""
    skip = tuple(str(Path(p)) + os.sep for p in {
        sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"],
        os.path.dirname(torch.__file__)})
    out = []
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not isinstance(file, str) or file.startswith(skip):
            continue
        try:
            st = os.stat(file)
        except OSError:
            continue
        out.append([file, st.st_size, st.st_mtime_ns])
    return sorted(out)


def _unchanged(files: list[list[Any]]) -> bool:
    for file, size, mtime in files:
        try:
            st = os.stat(str(file))
        except OSError:
            return False
        if st.st_size != size or st.st_mtime_ns != mtime:
            return False
    return True
