"""The same pick every time: measured numbers the planner reads are made steady before it reads
them, and near-ties are broken by a fixed rule.

Three rules (docs/API.md, "The same pick every time"):

1. **Links: a robust statistic, a stated resolution, kept with the profile.** The link probe
   (``world/network.measure_network``, itself a median of ping-pongs) is run up to
   ``PROBES`` times and each number's median kept; every number is rounded to
   ``SIGNIFICANT`` significant figures; rank 0 keeps the result on disk
   (``$VARUNA_FX_CACHE_DIR/links``, keyed by the world size, ranks per node, rank 0's host and
   the backend) and, when a later probe is within a factor of ``KEEP_FACTOR`` of what it
   kept on every number, plans with the kept numbers instead (a real change of the links --
   shaping, another network -- moves them by more, and replaces them). Rank 0's answer is
   broadcast, so every rank plans with the same numbers.
2. **Costs at a stated resolution**: measured times enter the planner rounded to
   ``SIGNIFICANT_COSTS`` significant figures (``round_significant``).
3. **Near-ties go to the simpler configuration**: among the listed candidates whose time per
   sample is within ``TIE_TOLERANCE`` of the fastest, the pick is the one with the fewest
   devices, then the fewest stages, then the largest micro-batch, then the schedule listed
   first (``simplicity``): a 1% difference in a noisy measurement does not buy a pipeline.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import socket
import statistics
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch.distributed as dist

from ..world import safe_json
from ..world.files import cache_dir, write_atomically
from ..world.network import NetworkProfile, measure_network
from ..world.where import local_world_size

SIGNIFICANT = 2  # significant figures of every measured link number (latency, bandwidth)
SIGNIFICANT_COSTS = 3  # significant figures of every measured time the planner prices
PROBES = 3  # link probes whose median is kept (one when the kept links agree)
KEEP_FACTOR = 2.0  # a probe within this factor of the kept links keeps them
TIE_TOLERANCE = 0.03  # relative: candidates this close to the fastest are tied

_FIELDS = ("latency", "bandwidth", "allreduce_latency", "allreduce_bandwidth")


def round_significant(value: float, digits: int = SIGNIFICANT) -> float:
    """``value`` to ``digits`` significant figures (0, inf and nan as they are)."""
    if value == 0 or not math.isfinite(value):
        return float(value)
    return float(f"{value:.{digits - 1}e}")


def round_costs(values: np.ndarray, digits: int = SIGNIFICANT_COSTS) -> np.ndarray:
    """``values`` (seconds or bytes), each to ``digits`` significant figures."""
    out = np.array(values, dtype=float)
    mask = np.isfinite(out) & (out != 0)
    scale = 10.0 ** (np.floor(np.log10(np.abs(out[mask]))) - (digits - 1))
    out[mask] = np.round(out[mask] / scale) * scale
    return out


def rounded(net: NetworkProfile) -> NetworkProfile:
    """Every number of ``net`` at the stated resolution."""
    return dataclasses.replace(
        net, **{f: round_significant(getattr(net, f)) for f in _FIELDS},
        link_latencies=tuple(round_significant(x) for x in net.link_latencies),
        link_bandwidths=tuple(round_significant(x) for x in net.link_bandwidths))


def median_network(probes: Sequence[NetworkProfile]) -> NetworkProfile:
    """Per number, the median over ``probes`` (all of one world)."""
    first = probes[0]

    def mid(values: Sequence[float]) -> float:
        return float(statistics.median(values))

    per_link = len(first.link_latencies)
    return NetworkProfile(
        *(mid([getattr(p, f) for p in probes]) for f in _FIELDS), first.world_size,
        tuple(mid([p.link_latencies[i] for p in probes]) for i in range(per_link)),
        tuple(mid([p.link_bandwidths[i] for p in probes]) for i in range(per_link)))


def agrees(new: NetworkProfile, kept: NetworkProfile, factor: float = KEEP_FACTOR) -> bool:
    """Whether every number of ``new`` is within ``factor`` of ``kept``'s (same world)."""
    if new.world_size != kept.world_size or \
            len(new.link_bandwidths) != len(kept.link_bandwidths):
        return False
    pairs = [(getattr(new, f), getattr(kept, f)) for f in _FIELDS]
    pairs += list(zip(new.link_latencies, kept.link_latencies))
    pairs += list(zip(new.link_bandwidths, kept.link_bandwidths))
    for a, b in pairs:
        if a <= 0 or b <= 0:  # a zero latency (too small to see) agrees with a small one
            if max(a, b) > 1e-4:
                return False
            continue
        if max(a / b, b / a) > factor:
            return False
    return True


def steady(probe: Callable[[], NetworkProfile | None] = measure_network,
           probes: int = PROBES) -> NetworkProfile | None:
    """The links to plan with, the same on every rank (collective: every rank calls it).

    ``probe`` (the link probe; its numbers are agreed by all ranks) runs once; rank 0
    compares it with the links it kept for this job's shape and broadcasts its decision:
    the kept links when they agree, else every rank probes ``probes - 1`` more times and
    the rounded median is planned with (and kept by rank 0). None without a process group."""
    first = probe()
    if first is None:
        return None
    rank0 = dist.get_rank() == 0
    key = links_key(dist.get_world_size(), local_world_size(), str(dist.get_backend()))
    decision: list[NetworkProfile | None] = [None]
    if rank0:
        kept = load(key)
        decision[0] = kept if kept is not None and agrees(first, kept) else None
    dist.broadcast_object_list(decision, src=0)
    if decision[0] is not None:
        return decision[0]
    more = [probe() for _ in range(probes - 1)]
    found = rounded(median_network([first, *(p for p in more if p is not None)]))
    if rank0:
        store(key, found)
    return found


def links_key(world: int, per_node: int, backend: str) -> str:
    """The kept links' key: the job's shape and rank 0's host (the caller is rank 0)."""
    text = json.dumps([world, per_node, socket.gethostname(), backend])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def load(key: str) -> NetworkProfile | None:
    """The kept links under ``key``, or None (missing, unreadable or not finite positive
    numbers: measured again)."""
    path = cache_dir("links") / f"{key}.json"
    try:
        data = safe_json.loads(path.read_text())
        net = NetworkProfile(**data)
    except (OSError, ValueError, TypeError):
        return None
    numbers = [*(getattr(net, f) for f in _FIELDS), *net.link_latencies, *net.link_bandwidths]
    if not all(isinstance(x, float) and math.isfinite(x) and x >= 0 for x in numbers) or \
            not isinstance(net.world_size, int) or net.world_size < 2:
        return None
    return net


def store(key: str, net: NetworkProfile) -> None:
    directory = cache_dir("links")
    try:
        write_atomically(directory, f"{key}.json", json.dumps(dataclasses.asdict(net)))
    except OSError as exc:
        warnings.warn(f"could not keep the measured links in {directory}: {exc}", stacklevel=2)


def simplicity(stages: int, data_parallel: int, micro_batch_size: int,
               schedule_rank: int) -> tuple[int, int, int, int]:
    """The tie rule's order (smaller is simpler): fewest devices, fewest stages, largest
    micro-batch, the schedule listed first."""
    return (stages * data_parallel, stages, -micro_batch_size, schedule_rank)


def tied(per_sample: Sequence[float], tolerance: float = TIE_TOLERANCE) -> list[int]:
    """Indices of the values within ``tolerance`` of the smallest."""
    best = min(per_sample)
    return [i for i, v in enumerate(per_sample) if v <= best * (1 + tolerance)]
