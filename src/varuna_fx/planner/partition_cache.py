"""The partition pass's answer, kept in the process and on disk beside the search's.

After the search (whose answer ``cache.py`` keeps), a compile runs the partition pass
(``configure.assign_and_price``): the exact DP over every node, re-run until its schedule's stash
counts settle, and weighed against the search's own partition. On the 70B Llama at P=28, D=2 that
is 3-4 CPU s, most of a warm re-plan (bench/RESULTS.md, "Planning a 7B and a 70B Llama"). Its
answer is a :class:`~varuna_fx.passes.partition.Partition` (a few tuples of numbers); the plan's
schedule and step are priced again from it (``configure.price``, a fraction of a second).

The key is the plan cache's (``cache.search_key``) over the search's own key (the cost table,
cluster, network, options, code), the partition problem the pass reads (every array byte for
byte: the graph's node costs, memory, cut bytes, the cost setting's cap, bandwidths, stash counts,
all-reduce weights) and the configuration it partitions for (P, the stash counts, the search's
own bounds). A configuration that was not searched (P given) has no search key: its partition
is not kept. ``VARUNA_FX_PLAN_CACHE`` governs it as it does the search's (``off``, ``memory``).

A client of the cache service (``world/disk_cache.py``): its memory layer, and files
``$VARUNA_FX_CACHE_DIR/partitions/<key>.json``, JSON sealed with this user's key (reading it runs
no code; a damaged, edited or planted file is ignored with a ``CacheWarning``), the newest
:data:`MAX_ENTRIES` kept.
"""

from __future__ import annotations

from typing import Any

from ..passes.partition import Partition, PartitionProblem
from ..world.disk_cache import DiskCache
from .cache import search_key

FORMAT = 2  # 2: sealed with this user's key (the cache service)
MAX_ENTRIES = 64
CACHE: DiskCache[Partition] = DiskCache("partitions", FORMAT, MAX_ENTRIES, family="plans",
                                        memory=True)
# what happened in this process: hit (memory or disk), miss, write, ignored (a bad file)
stats = CACHE.stats


def partition_key(search: str | None, costs: PartitionProblem, stages: int,
                  stash_counts: tuple[int, ...], searched_bounds: tuple[int, ...] | None
                  ) -> str | None:
    """The key of the partition pass over ``costs`` for a configuration the search with key
    ``search`` chose; None when it has none (nothing searched, or the cache is off)."""
    if search is None:
        return None
    return search_key("partition", search, costs, stages, tuple(stash_counts),
                      searched_bounds)


def load(key: str | None) -> Partition | None:
    return CACHE.load(key, _decode) if key is not None else None


def store(key: str | None, made: Partition) -> None:
    if key is not None:
        CACHE.store(key, made, {"partition": _to_json(made)})


def clear() -> None:
    CACHE.clear()


def _to_json(made: Partition) -> dict[str, Any]:
    # floats as JSON numbers: Python writes their repr, which reads back exactly
    return {"bounds": list(made.bounds), "stage_times": list(made.stage_times),
            "stage_memory": list(made.stage_memory), "bottleneck": made.bottleneck,
            "recompute": list(made.recompute), "allreduce": list(made.allreduce)}


def _decode(entry: dict[str, Any]) -> Partition:
    p = entry["partition"]
    bounds = tuple(int(x) for x in p["bounds"])
    stages = len(bounds) - 1
    made = Partition(
        bounds=bounds, stage_times=tuple(float(x) for x in p["stage_times"]),
        stage_memory=tuple(float(x) for x in p["stage_memory"]),
        bottleneck=float(p["bottleneck"]),
        recompute=tuple(bool(x) for x in p["recompute"]),
        allreduce=tuple(float(x) for x in p["allreduce"]))
    if stages < 1 or bounds[0] != 0 or list(bounds) != sorted(set(bounds)) or \
            len(made.stage_times) != stages or len(made.stage_memory) != stages or \
            len(made.recompute) not in (0, stages) or len(made.allreduce) not in (0, stages):
        raise ValueError("impossible values")
    return made
