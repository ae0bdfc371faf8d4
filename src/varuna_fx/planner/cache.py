"""A cache of the planner's search, in the process and on disk, keyed by what the search reads.

A restarted job, a re-plan back to a world size seen before (a node that left and came back)
and every rank of a job compiling the same model all run the same search: the branch and bound
of ``search.py`` over the same cost table, cluster and options, whose answer is a handful of
numbers (P, D, the micro-batch size, the schedule, the rows of ``plan.alternatives``). This
module keeps that answer.

The key is a SHA-256 of everything the search is a function of, so a hit is what the search
would return: the cost table itself (every coefficient array, byte for byte: a model with other
shapes, other operations or other measured times has another table), the cluster, the network,
every planning option (``PlanOptions``: the cluster, batch, the given P / D / micro-batch size,
the schedule, recompute, sharding, compression, replica sync), the example batch, the recompute
setting planned for, the running world (``P x D`` must use exactly its ranks), and the code:
the source of ``planner/``, ``schedule/``, ``costs/``, ``passes/`` and ``world/``, the
varuna_fx, torch and Python versions. Anything in them this module cannot write down exactly (an object whose ``repr``
names its address, a replica sync that is not a plain name) makes the search uncacheable: it
then simply runs. What the search does not read is not in the key: the graph's code beyond its
costs (a re-plan partitions and generates code from the graph afresh: only the search is
reused).

Where: in the process a dict (:data:`_MEMORY`, the newest :data:`MAX_ENTRIES`), and on disk
``$VARUNA_FX_CACHE_DIR/plans/<key>.json`` (default ``~/.cache/varuna_fx/plans``), sealed JSON
(``world/files.sealed``: reading it runs no code and an edited or corrupted file is noticed),
written atomically, at most :data:`MAX_ENTRIES` files kept. A file that cannot be used (corrupt,
another format, another key) is ignored with a :class:`PlanCacheWarning` and rewritten; it is
never an error. ``VARUNA_FX_PLAN_CACHE=0`` turns both off; ``=memory`` keeps only the process's.

Use (``configure.choose_configuration`` does this around ``Planner.search``):
``key = search_key(...)``; ``found = load(key)``; on a miss search, then ``store(key, found)``.
A search that finds nothing that fits is kept too (:class:`Refused`, its ``PlanError``'s
message), so that compile's ``recompute="auto"``, which plans without recomputation first,
does not pay that refused search again on every re-plan.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import sys
import warnings
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..world import switches
from ..world.files import cache_dir, read_entry, write_entry
from .plan import Alternative

FORMAT = 1
MAX_ENTRIES = 64
# what happened in this process (tests and benchmarks read it): hit (memory or disk), miss,
# write, uncacheable, ignored (a file that could not be used)
stats: Counter[str] = Counter()
_MEMORY: OrderedDict[str, Searched | Refused] = OrderedDict()
_PACKAGE = Path(__file__).resolve().parent.parent
_CODE = ("planner", "schedule", "costs", "passes", "world")


class PlanCacheWarning(UserWarning):
    """A plan-cache file was ignored (corrupt, edited, or written by another format)."""


@dataclass(frozen=True)
class Searched:
    """What ``choose_configuration`` keeps of a search: the pick, its rows and what compile
    starts the partition from."""

    stages: int
    data_parallel: int
    micro_batch_size: int
    schedule: str
    shard: bool
    stages_per_rank: int  # v chosen (virtual stages weighed): 1 otherwise
    alternatives: tuple[Alternative, ...]
    searched: tuple[int, ...] | None  # the search's own cuts (node positions), or None
    run_counts: tuple[int, ...] | None  # the stash counts the pick's memory was checked at
    sync: tuple[str, ...]  # the pick's replica sync per stage, as the search priced it

    def to_json(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                "alternatives": [dataclasses.asdict(a) for a in self.alternatives]}

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> Searched:
        def ints(value: Any) -> tuple[int, ...] | None:
            return None if value is None else tuple(int(x) for x in value)

        rows = tuple(Alternative(**{**a, "stage_memory": tuple(a["stage_memory"])})
                     for a in entry["alternatives"])
        return cls(int(entry["stages"]), int(entry["data_parallel"]),
                   int(entry["micro_batch_size"]), str(entry["schedule"]), bool(entry["shard"]),
                   int(entry["stages_per_rank"]), rows, ints(entry["searched"]),
                   ints(entry["run_counts"]), tuple(str(s) for s in entry["sync"]))


@dataclass(frozen=True)
class Refused:
    """A search that found nothing that fits: its ``PlanError``'s message. Compile's
    ``recompute="auto"`` plans without recomputation first and, where that is refused, with
    it: a re-plan keeps paying that first search unless its refusal is kept too."""

    message: str


def mode() -> str:
    """"disk" (the default: memory and disk), "memory" or "off" (``$VARUNA_FX_PLAN_CACHE``)."""
    return switches.read("VARUNA_FX_PLAN_CACHE")


class _Unwritable(Exception):
    """A value the key cannot describe exactly."""


def search_key(*parts: Any) -> str | None:
    """The key of a search over ``parts`` (the cost table, cluster, options...: see the module
    docstring), or None when the cache is off or a part cannot be written down exactly."""
    if mode() == "off":
        return None
    digest = hashlib.sha256()
    try:
        for part in (FORMAT, _code_digest(), torch.__version__, sys.version_info[:2], *parts):
            _feed(digest, part)
    except _Unwritable:
        stats["uncacheable"] += 1
        return None
    return digest.hexdigest()[:40]


def _feed(digest: Any, value: Any) -> None:
    """Write ``value`` into ``digest`` exactly: arrays byte for byte, dataclasses field by field
    (with their type's name), containers item by item, floats by ``repr`` (exact)."""
    def put(text: str) -> None:
        digest.update(text.encode())
        digest.update(b"\x00")

    if value is None or isinstance(value, (bool, int, str, enum.Enum)):
        put(f"{type(value).__name__}:{value!r}")
    elif isinstance(value, float):
        put(f"float:{value!r}")
    elif isinstance(value, np.ndarray):
        put(f"array:{value.dtype}:{value.shape}")
        digest.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, np.generic):
        put(f"{type(value).__name__}:{value.item()!r}")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        put(f"dataclass:{type(value).__module__}.{type(value).__qualname__}")
        for f in dataclasses.fields(value):
            if not f.init:  # derived state (a memo), not a setting
                continue
            put(f.name)
            _feed(digest, getattr(value, f.name))
    elif isinstance(value, Mapping):
        put(f"dict:{len(value)}")
        for k in sorted(value, key=repr):
            _feed(digest, k)
            _feed(digest, value[k])
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        put(f"{type(value).__name__}:{len(items)}")
        for item in items:
            _feed(digest, item)
    elif callable(value) and hasattr(value, "__qualname__"):  # a generator of a schedule entry
        put(f"callable:{getattr(value, '__module__', '')}.{value.__qualname__}")
    else:
        text = repr(value)
        if " at 0x" in text or " object at " in text:  # an identity, not a value
            raise _Unwritable(text)
        put(f"{type(value).__module__}.{type(value).__qualname__}:{text}")


@lru_cache(maxsize=1)
def _code_digest() -> str:
    """The source of the code the search runs (a changed generator or memory model makes
    another plan), with varuna_fx's version."""
    # the version read, not imported: the package root sits above this layer (and is loaded)
    version = str(getattr(sys.modules.get("varuna_fx"), "__version__", ""))
    digest = hashlib.sha256(version.encode())
    for folder in _CODE:
        for path in sorted((_PACKAGE / folder).glob("*.py")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def load(key: str | None) -> Searched | Refused | None:
    """The search stored under ``key``: from the process, else from disk; None on a miss."""
    if key is None:
        return None
    found = _MEMORY.get(key)
    if found is not None:
        _MEMORY.move_to_end(key)
        stats["hit"] += 1
        return found
    if mode() == "disk":
        found = _load_file(key)
        if found is not None:
            _remember(key, found)
            stats["hit"] += 1
            return found
    stats["miss"] += 1
    return None


def _load_file(key: str) -> Searched | Refused | None:
    try:
        entry = read_entry("plans", key, FORMAT)
        if entry is None:
            return None
        if "refused" in entry:
            return Refused(str(entry["refused"]))
        found = Searched.from_json(entry["searched"])
        if min(found.stages, found.data_parallel, found.micro_batch_size,
               found.stages_per_rank) < 1 or not found.alternatives:
            raise ValueError("impossible values")
        return found
    except (ValueError, KeyError, TypeError) as e:
        stats["ignored"] += 1
        path = cache_dir("plans") / f"{key}.json"
        warnings.warn(f"varuna_fx: ignoring the plan cache file {path} ({e}); the planner "
                      "searches again and rewrites it", PlanCacheWarning, stacklevel=3)
        return None


def store(key: str | None, found: Searched | Refused) -> None:
    """Keep ``found`` under ``key`` in the process and, unless the cache is memory-only, on
    disk (atomically; a cache that cannot be written is skipped silently: it only saves
    time)."""
    if key is None:
        return
    _remember(key, found)
    if mode() != "disk":
        return
    answer = {"refused": found.message} if isinstance(found, Refused) else \
        {"searched": found.to_json()}
    if write_entry("plans", key, FORMAT, answer, MAX_ENTRIES):
        stats["write"] += 1


def clear() -> None:
    """Forget the process's entries (the files stay), and the memos ``shared_memo`` keeps."""
    _MEMORY.clear()
    _MEMOS.clear()


# What pricers worked out (``pricing.Memo``: partitions, orders, finished candidates), by
# everything they price with but the number of GPUs, the newest MAX_MEMOS kept.
_MEMOS: OrderedDict[str, Any] = OrderedDict()
MAX_MEMOS = 2


def shared_memo(pricer: Any) -> None:
    """Give ``pricer`` the memo of an earlier pricer of this process that differed at most in
    the cluster's number of GPUs (a re-plan after a node left or joined), so its search
    takes every candidate that search priced (partitions, orders, simulated steps) from it.

    Why that is exact: a candidate's price is a function of its own P, D and micro-batch size
    and the pricer's settings; the cluster's size only decides which candidates exist
    (``P x D <= GPUs``), and a placement's links depend on the GPUs per node, not on how many
    nodes there are (``network.links``). The key is the plan cache's (a SHA-256 of the cost
    table, cluster, network, settings and code), without the GPU count; nothing is shared
    where the cache is off."""
    cluster = pricer.cluster
    if mode() == "off":
        return
    key = search_key("pricer memo", pricer.table, pricer.spec, pricer.network,
                     {f.name: getattr(cluster, f.name) for f in dataclasses.fields(cluster)
                      if f.name != "gpus"},
                     pricer.schedules, pricer.recompute, pricer.memory_cap,
                     pricer.stages_per_rank, pricer.shard_optimizer, pricer.compression,
                     pricer.replica_sync)
    if key is None:
        return
    if key in _MEMOS:
        _MEMOS.move_to_end(key)
        object.__setattr__(pricer, "memo", _MEMOS[key])
        stats["memo shared"] += 1
        return
    _MEMOS[key] = pricer.memo
    while len(_MEMOS) > MAX_MEMOS:
        _MEMOS.popitem(last=False)


def _remember(key: str, found: Searched | Refused) -> None:
    _MEMORY[key] = found
    _MEMORY.move_to_end(key)
    while len(_MEMORY) > MAX_ENTRIES:
        _MEMORY.popitem(last=False)
