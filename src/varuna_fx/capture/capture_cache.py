"""Captured graphs kept on disk, so a restarted or joining process of a job does not capture.

A client of the cache service (``world/disk_cache.py``: the switch, the keyed seal, the
damaged-entry rule, the rule for noticing changed code). An entry is the graph ``graph_json``
writes, under the key ``model_key.capture_key`` takes from the model before tracing (its code,
everything its code reads, its state and the example inputs). It also lists every source file
the process had loaded when it captured, outside Python's and torch's own (their versions are in
the key), with its size and modification time: an entry is used only while all of them are
unchanged, so an edit to code the key's walk does not reach still makes a fresh capture.

Files: ``$VARUNA_FX_CACHE_DIR/captures/<key>.json`` (default ``~/.cache/varuna_fx/captures``),
sealed with this user's key, at most :data:`MAX_ENTRIES` kept. Loading runs no code
(``graph_json``), and the graph it gives calls only side-effect-free tensor operations. An
unreadable, damaged, stale or mismatching entry is ignored (with a ``CacheWarning`` where it is
damaged) and rewritten, never an error. ``VARUNA_FX_CACHE_MODE=0`` (or the older
``VARUNA_FX_GRAPH_CACHE=0``) turns it off, with the shape pass's cache.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..world.disk_cache import DiskCache
from .captured import Captured
from .graph_json import Unwritable, decode_captured, encode_captured
from .inputs import BoundInputs

FORMAT = 2  # 2: sealed with this user's key; the key covers every global forward reads
MAX_ENTRIES = 16
CACHE: DiskCache[Captured] = DiskCache("captures", FORMAT, MAX_ENTRIES, family="graphs",
                                       watch_files=True)
# what happened in this process (tests and benchmarks read it): hit, miss, write, unwritable,
# stale (a source file changed since), ignored (a file that could not be used)
stats = CACHE.stats


def enabled() -> bool:
    """Whether the graph caches (this one and the shape pass's) are on."""
    return CACHE.mode() != "off"


def load(key: str, model: nn.Module, bound: BoundInputs) -> Captured | None:
    """The capture stored under ``key``, bound to ``model``; None when there is none usable."""
    return CACHE.load(key, lambda entry: decode_captured(entry["captured"], model, bound))


def store(key: str, captured: Captured, model: nn.Module) -> None:
    """Write ``captured`` under ``key`` (a graph that cannot be written is skipped: it only
    saves time, as does a cache folder that cannot be written)."""
    try:
        data: dict[str, Any] = encode_captured(captured, model)
    except Unwritable:
        stats["unwritable"] += 1
        return
    CACHE.store(key, captured, {"captured": data})
