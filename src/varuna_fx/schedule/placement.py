"""Placement: which rank runs which (stage, replica), and which ranks talk to each other.

Varuna keeps a replica's consecutive stages on one node, so the frequent point-to-point
activation/gradient traffic stays on the fast intra-node links and only the once-per-step
gradient all-reduce crosses nodes. torchrun numbers ranks node by node (ranks
``[n * gpus_per_node, (n + 1) * gpus_per_node)`` are node ``n``), so numbering replica-major,

    rank = replica * R + pipeline_rank(stage)

(``R = P / v`` ranks per replica) puts the ranks of a replica next to each other: when
``gpus_per_node >= R`` a node holds whole pipelines (plus at most the ends of two), and when
``gpus_per_node < R`` a pipeline crosses only the ``ceil(R / gpus_per_node) - 1`` node
boundaries it must. The replicas of one stage are R ranks apart, which is where the all-reduce
goes.

Virtual stages (``stages_per_rank = v > 1``): each rank runs v of the P stages. ``"looped"``
puts stage s on pipeline rank ``s mod R`` (interleaved 1F1B: every boundary crosses ranks, so
about v times 1F1B's point-to-point bytes); ``"v"`` puts stages r and 2R-1-r on rank r (ZB-V:
the turn at the last rank is local and the first and last stages share rank 0, so a tied
embedding and head need no cross-rank sum). Pure functions: tested without processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import DistributedError, ScheduleError

STYLES = ("looped", "v")


def stage_ranks(stages: int, stages_per_rank: int, style: str = "looped") -> tuple[int, ...]:
    """The pipeline rank of each of ``stages`` stages when each rank runs ``stages_per_rank``."""
    v = stages_per_rank
    if v < 1 or stages % v:
        raise ScheduleError(
            f"stages_per_rank={v} must be a positive divisor of the {stages} stages"
        )
    r = stages // v
    if v == 1:
        return tuple(range(stages))
    if style == "looped":
        return tuple(s % r for s in range(stages))
    if style == "v":
        if v != 2:
            raise ScheduleError(
                f"the V-shape placement puts exactly 2 stages on each rank, not {v}: use "
                "stages_per_rank=2 (or the looped placement of interleaved-1f1b)"
            )
        return tuple(s if s < r else 2 * r - 1 - s for s in range(stages))
    raise ScheduleError(f"unknown placement style {style!r}; choose one of {STYLES}")


@dataclass(frozen=True)
class Placement:
    stages: int  # P: model stages per replica
    replicas: int  # D
    stages_per_rank: int = 1  # v: a rank runs v stages (virtual stages)
    style: str = "looped"  # how stages map to ranks when v > 1 (see the module doc)
    # the pipeline rank of each stage (derived; checks stages_per_rank and style)
    _ranks: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_ranks",
                           stage_ranks(self.stages, self.stages_per_rank, self.style))

    @property
    def ranks_per_replica(self) -> int:
        """R = P / v: the ranks one replica's pipeline occupies."""
        return self.stages // self.stages_per_rank

    @property
    def world_size(self) -> int:
        return self.ranks_per_replica * self.replicas

    def pipeline_rank(self, stage: int) -> int:
        """The position of ``stage``'s rank within its replica (0 .. R-1)."""
        return self._ranks[stage]

    def rank(self, stage: int, replica: int) -> int:
        return replica * self.ranks_per_replica + self.pipeline_rank(stage)

    def coords(self, rank: int) -> tuple[int, int]:
        """``rank`` -> ``(its first stage, replica)`` (its only stage when v == 1)."""
        replica, position = divmod(rank, self.ranks_per_replica)
        return self._ranks.index(position), replica

    def stages_of(self, rank: int) -> list[int]:
        """Every stage ``rank`` runs, in stage order."""
        position = rank % self.ranks_per_replica
        return [s for s, r in enumerate(self._ranks) if r == position]

    def pipeline_ranks(self, replica: int) -> list[int]:
        """The R ranks of one replica, in pipeline-rank order (activations and gradients flow
        here)."""
        return [replica * self.ranks_per_replica + r for r in range(self.ranks_per_replica)]

    def replica_ranks(self, stage: int) -> list[int]:
        """The D ranks holding one stage (its gradient all-reduce)."""
        return [self.rank(stage, r) for r in range(self.replicas)]

    def holder_ranks(self, stages: list[int]) -> list[int]:
        """Every rank holding a copy of a parameter tied across ``stages``, in every replica
        (once each: with virtual stages a rank may hold several of them)."""
        return sorted({self.rank(s, r) for s in stages for r in range(self.replicas)})


def check_world_size(world: int, stages: int, replicas: int, stages_per_rank: int = 1) -> None:
    ranks = stages // stages_per_rank
    if world != ranks * replicas:
        need = ranks * replicas
        hint = f"launch {need} processes (varuna-fx run --nproc {need} ...)"
        if world % ranks == 0:
            hint += f", or compile with data_parallel={world // ranks}"
        else:
            divisors = [p for p in range(1, world + 1) if world % p == 0]
            hint += f", or compile with stages= one of {divisors}"
            if stages_per_rank > 1:
                hint += f" times stages_per_rank={stages_per_rank}"
        shape = f"P x D = {stages} x {replicas}" if stages_per_rank == 1 else \
            f"P / v x D = {stages} / {stages_per_rank} x {replicas}"
        raise DistributedError(
            f"the world has {world} ranks but the plan needs {shape} = {need}: {hint}"
        )
