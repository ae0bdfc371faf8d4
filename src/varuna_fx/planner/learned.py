"""What the plan learns from its own first steps: the step's fixed cost outside the schedule.

The cost model prices every action a schedule runs (its operations and the fixed cost per
action, ``machine.py``), the messages and the all-reduce. What a step also spends, on no
action of its timeline, is priced by nothing: the step's own bookkeeping (checking the
batch and the model, splitting the micro-batches, starting the reductions, the loss
all-reduce that closes a distributed step, the ranks' skew it absorbs). On this machine it is
about 0.4 ms a step in one process and 3.5-7.6 ms on 2 gloo ranks for the bench GPT
(bench/RESULTS.md, bench_planner_truth.py): 7-12% of a step the planner said nothing of.

:class:`StepLearner` watches a pipeline's first steps like the drift check does: it skips the
first (warm-up), and from the next :data:`STEPS` takes the median of each step's wall time
minus the time its actions cover (:func:`outside_actions`, from ``pipe.last_step``'s
timeline). Rank 0 keeps it (:func:`remember`) under a key of the graph, the world (ranks,
ranks per node), the device and threads (:func:`learn_key`). A value learned again that
agrees with the kept one (within 2x or 1 ms: :func:`agrees`) leaves it as it was, so plans
stay the same from one compile to the next (issue 41, item 2). The
planner reads it when it prices (``machine.planning_times``, rank 0's in a launched job, so
every rank plans alike) and adds it to every candidate's step, and the plan's terms show it
("step overhead"). Before anything is learned the step's fixed cost is estimated as the loss
all-reduce of a distributed step over the measured links (:func:`estimated_step_overhead`).

Kept in the cache service (``world/disk_cache.py``: sealed, bounded JSON, code-versioned),
``$VARUNA_FX_CACHE_DIR/learned``. Nothing is learned where the plan was not priced with this
machine's costs, or the machine is stated (``$VARUNA_FX_MACHINE``: the test suite, whose plans
must not depend on what ran before).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ..world.disk_cache import DiskCache
from ..world.network import NetworkProfile
from .steady import KEEP_FACTOR, round_significant

FORMAT = 1
STEPS = 5  # steps after the first whose median is kept (robust to two slow ones)
KEEP_ABSOLUTE = 1e-3  # seconds: a newly learned overhead this close to the kept one keeps it

Timeline = Sequence[tuple[int, str, int, float, float]]

CACHE: DiskCache[float] = DiskCache("learned", FORMAT, 256, family="plans", memory=True)


def learn_key(graph: str, ranks: int, ranks_per_node: int, device: str, threads: int,
              dtype: str) -> str:
    """The key a step overhead is kept under for this graph and world."""
    return CACHE.key(repr((graph, int(ranks), int(ranks_per_node), device, int(threads),
                           dtype)))


def outside_actions(seconds: float, timeline: Timeline) -> float:
    """Seconds of a step of ``seconds`` that no entry of ``timeline`` covers (the union of
    the entries' spans, so nested or overlapping ones count once)."""
    spans = sorted((float(a), float(b)) for _, _, _, a, b in timeline if b > a)
    covered, end = 0.0, -math.inf
    for a, b in spans:
        if a > end:
            covered += b - a
            end = b
        elif b > end:
            covered += b - end
            end = b
    return max(float(seconds) - covered, 0.0)


def recall(key: str | None) -> float | None:
    """The step overhead kept under ``key``, or None."""
    if key is None:
        return None
    return CACHE.load(key, _decode)


def _decode(entry: dict) -> float:
    value = entry["seconds"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or not 0 <= value < 60:
        raise ValueError(f"not a step overhead in seconds: {value!r}")
    return float(value)


def agrees(new: float, kept: float) -> bool:
    """Whether a newly learned overhead agrees with the kept one: within ``KEEP_FACTOR``
    (the kept links' rule, ``steady.py``) or ``KEEP_ABSOLUTE`` seconds of it."""
    low, high = sorted((max(new, 0.0), max(kept, 0.0)))
    return high - low <= KEEP_ABSOLUTE or high <= KEEP_FACTOR * low


def remember(key: str | None, seconds: float) -> bool:
    """Keep ``seconds`` under ``key``, rounded to the links' stated resolution, unless the
    value kept there agrees with it (:func:`agrees`): a re-run that measures a little more or
    less keeps the plans as they were; one that is far off (the first run shared the machine,
    the code changed what a step does) replaces it. Whether it was written."""
    if key is None:
        return False
    kept = recall(key)
    if kept is not None and agrees(seconds, kept):
        return False
    value = round_significant(max(float(seconds), 0.0))
    return CACHE.store(key, value, {"seconds": value})


def estimated_step_overhead(ranks: int, network: NetworkProfile | None) -> float:
    """Before anything is learned: a distributed step's loss all-reduce (the measured links'
    all-reduce latency); nothing in one process or without measured links."""
    if ranks <= 1 or network is None or not math.isfinite(network.allreduce_latency):
        return 0.0
    return max(float(network.allreduce_latency), 0.0)


@dataclass
class StepLearner:
    """Watches a pipeline's first steps and keeps their overhead outside the actions (once).

    ``key``: ``Plan.learn_key`` (None: learns nothing); ``keeps``: whether this process keeps
    what it learns (rank 0 of a job; every process of a one-process run)."""

    key: str | None
    keeps: bool = True
    seen: int = 0
    done: bool = False

    def __post_init__(self) -> None:
        self.samples: list[float] = []
        self.done = self.done or self.key is None or not self.keeps

    def observe(self, seconds: float, timeline: Timeline) -> float | None:
        """The overhead learned at this step (then kept), or None."""
        if self.done:
            return None
        self.seen += 1
        if self.seen == 1 or not timeline:
            return None  # warm-up; a run without a timeline tells nothing
        self.samples.append(outside_actions(seconds, timeline))
        if len(self.samples) < STEPS:
            return None
        self.done = True
        learned = statistics.median(self.samples)
        remember(self.key, learned)
        return learned
