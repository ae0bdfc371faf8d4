"""What the planner searches over: a candidate configuration (P, D, micro-batch size), the space
of them, and the search's result (the schedules a search weighs: ``schedule/registry.py``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from .balance import PartitionCosts
from .plan import Alternative


@dataclass
class Candidate:
    stages: int
    data_parallel: int
    micro_batch_size: int
    num_micro_batches: int
    plan: PartitionCosts | None = None
    # stash counts the partition was made for; None: one micro-batch per stage (a relaxation)
    stash_counts: tuple[int, ...] | None = None
    # the stash counts of the order it was simulated with (``Pricer.finish``): its memory
    # was checked at these, so the partition pass starts from them
    run_counts: tuple[int, ...] | None = None
    exact: bool = False  # partitioned with the schedule's real stash counts
    step_time: float = math.inf
    allreduce_time: float = 0.0
    bubble: float = 0.0
    memory: tuple[float, ...] = ()
    # the name of the schedule it is priced with (its registry entry: ``Pricer.kind``); ""
    # until a schedule="auto" search branches it (after partitioning: the floors before that
    # hold for every schedule)
    schedule: str = ""
    floor: float = 0.0  # seconds: the lower bound of its step it was last pushed with
    estimated: bool = False  # step_time is a cheaper order's (see Planner.search)
    shard: bool = False  # its memory counts the optimizer state sharded over D (ZeRO-1)
    # as it was simulated (``slow_links.py``): per boundary how it travels, per stage its
    # replica sync
    compression: tuple[str, ...] = ()
    sync: tuple = ()

    @property
    def samples(self) -> int:
        return self.data_parallel * self.micro_batch_size * self.num_micro_batches

    def alternative(self, chosen: bool = False) -> Alternative:
        return Alternative(self.stages, self.data_parallel, self.micro_batch_size,
                           self.num_micro_batches, self.step_time, self.bubble,
                           self.allreduce_time, self.memory, chosen, self.schedule,
                           self.shard)


@dataclass
class SearchResult:
    top: list[Candidate]  # best first
    considered: int = 0
    partitioned: int = 0
    simulated: int = 0
    seconds: float = 0.0
    alternatives: list[Alternative] = field(default_factory=list)
    stages_per_rank: int = 1  # v of the schedule searched (several stages per rank: virtual)
    recompute: bool = True  # whether it was planned with recomputation (plan_for sets it)
    # the first row is not the fastest but the simplest within the tie tolerance (steady.py)
    settled: bool = False

    @property
    def best(self) -> Candidate:
        return self.top[0]


@dataclass(frozen=True)
class Space:
    """What may vary: None means the planner chooses."""

    gpus: int
    example_batch: int
    global_batch_size: int | None = None
    stages: int | None = None
    data_parallel: int | None = None
    micro_batch_size: int | None = None
    world: int | None = None  # a running job: P x D must use exactly its ranks
    micro_batches: int | None = None  # grad_accum_steps: m fixed, b = the replica batch / m

    def replica_batch(self, replicas: int) -> int | None:
        if self.global_batch_size is None:
            return self.example_batch  # each replica steps on a batch like the example
        if self.global_batch_size % replicas:
            return None
        return self.global_batch_size // replicas


def weight_grads(backward: Sequence[float]) -> list[float]:
    """The weight-gradient part (``W``) of each stage's backward, for split-backward schedules:
    the first stage computes no input gradients (its inputs are the batch), so its whole
    backward is ``W`` and its ``B`` is free; later stages about half (as measured:
    bench/RESULTS.md, "Figures the code cites"). With one stage, nothing is split."""
    values = [float(b) / 2 for b in backward]
    if len(values) > 1:
        values[0] = float(backward[0])
    return values


def divisors(n: int) -> list[int]:
    return list(_divisors(n))


@lru_cache(maxsize=256)
def _divisors(n: int) -> tuple[int, ...]:
    # (the search asks for every D's replica batch: 10^3 times, a handful of distinct ones)
    return tuple(d for d in range(1, n + 1) if n % d == 0)


# How much faster the full order generator may be than the quick one (the most measured:
# 2.1%; see schedule/varuna.py QUICK_VARIANTS): a quick estimate e puts a floor under the
# full step, e / (1 + QUICK_SLACK), which is what the search orders estimated candidates by.
QUICK_SLACK = 0.05
