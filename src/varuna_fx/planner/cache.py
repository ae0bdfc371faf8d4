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
varuna_fx's source with the varuna_fx, torch and Python versions (the cache service's rule,
``world/disk_cache.code_digest``). Anything in them this module cannot write down exactly (an object whose ``repr``
names its address, a replica sync that is not a plain name) makes the search uncacheable: it
then simply runs. What the search does not read is not in the key: the graph's code beyond its
costs (a re-plan partitions and generates code from the graph afresh: only the search is
reused).

Where: a client of the cache service (``world/disk_cache.py``): in the process its memory
layer (the newest :data:`MAX_ENTRIES`), and on disk ``$VARUNA_FX_CACHE_DIR/plans/<key>.json``
(default ``~/.cache/varuna_fx/plans``), JSON sealed with this user's key (reading it runs no
code; an edited, corrupted or planted file is noticed), at most :data:`MAX_ENTRIES` files kept.
A file that cannot be used (damaged, another format, another key) is ignored with a
:class:`PlanCacheWarning` and rewritten; it is never an error. ``VARUNA_FX_CACHE_MODE`` (or the
older ``VARUNA_FX_PLAN_CACHE``, which wins for these caches) ``=0`` turns both off;
``=memory`` keeps only the process's.

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
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..world.disk_cache import CacheWarning, DiskCache
from .plan import Alternative

FORMAT = 2  # 2: sealed with this user's key (the cache service)
MAX_ENTRIES = 64


class PlanCacheWarning(CacheWarning):
    """A plan-cache file was ignored (damaged, edited, sealed by another writer, or written by
    another format)."""


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


CACHE: DiskCache[Searched | Refused] = DiskCache("plans", FORMAT, MAX_ENTRIES, family="plans",
                                                 memory=True, warning=PlanCacheWarning)
# what happened in this process (tests and benchmarks read it): hit (memory or disk), miss,
# write, uncacheable, ignored (a file that could not be used)
stats = CACHE.stats


def mode() -> str:
    """"disk" (the default: memory and disk), "memory" or "off" (``$VARUNA_FX_PLAN_CACHE``,
    else ``$VARUNA_FX_CACHE_MODE``)."""
    return CACHE.mode()


class _Unwritable(Exception):
    """A value the key cannot describe exactly."""


def search_key(*parts: Any) -> str | None:
    """The key of a search over ``parts`` (the cost table, cluster, options...: see the module
    docstring), or None when the cache is off or a part cannot be written down exactly."""
    if mode() == "off":
        return None
    digest = hashlib.sha256()
    try:
        for part in parts:
            _feed(digest, part)
    except _Unwritable:
        stats["uncacheable"] += 1
        return None
    return CACHE.key(digest.hexdigest())


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


def load(key: str | None) -> Searched | Refused | None:
    """The search stored under ``key``: from the process, else from disk; None on a miss."""
    return CACHE.load(key, _decode) if key is not None else None


def _decode(entry: dict[str, Any]) -> Searched | Refused:
    if "refused" in entry:
        return Refused(str(entry["refused"]))
    found = Searched.from_json(entry["searched"])
    if min(found.stages, found.data_parallel, found.micro_batch_size,
           found.stages_per_rank) < 1 or not found.alternatives:
        raise ValueError("impossible values")
    return found


def store(key: str | None, found: Searched | Refused) -> None:
    """Keep ``found`` under ``key`` in the process and, unless the cache is memory-only, on
    disk (atomically; a cache that cannot be written is skipped silently: it only saves
    time)."""
    if key is None:
        return
    answer = {"refused": found.message} if isinstance(found, Refused) else \
        {"searched": found.to_json()}
    CACHE.store(key, found, answer)


def clear() -> None:
    """Forget the process's entries (the files stay), and the memos ``shared_memo`` keeps."""
    CACHE.clear()
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
