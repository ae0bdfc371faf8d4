"""Placement: which rank runs which (stage, replica), and which ranks talk to each other.

Varuna keeps a replica's consecutive stages on one node, so the frequent point-to-point
activation/gradient traffic stays on the fast intra-node links and only the once-per-step
gradient all-reduce crosses nodes. torchrun numbers ranks node by node (ranks
``[n * gpus_per_node, (n + 1) * gpus_per_node)`` are node ``n``), so numbering replica-major,

    rank = replica * P + stage

puts the P stages of a replica on consecutive ranks: when ``gpus_per_node >= P`` a node holds
whole pipelines (plus at most the ends of two), and when ``gpus_per_node < P`` a pipeline crosses
only the ``ceil(P / gpus_per_node) - 1`` node boundaries it must. The replicas of one stage are
P ranks apart, which is where the all-reduce goes. Pure functions: tested without processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import DistributedError


@dataclass(frozen=True)
class Placement:
    stages: int  # P
    replicas: int  # D

    @property
    def world_size(self) -> int:
        return self.stages * self.replicas

    def rank(self, stage: int, replica: int) -> int:
        return replica * self.stages + stage

    def coords(self, rank: int) -> tuple[int, int]:
        """``rank`` -> ``(stage, replica)``."""
        replica, stage = divmod(rank, self.stages)
        return stage, replica

    def pipeline_ranks(self, replica: int) -> list[int]:
        """The P ranks of one replica, stage order (activations and gradients flow here)."""
        return [self.rank(s, replica) for s in range(self.stages)]

    def replica_ranks(self, stage: int) -> list[int]:
        """The D ranks holding one stage (its gradient all-reduce)."""
        return [self.rank(stage, r) for r in range(self.replicas)]

    def holder_ranks(self, stages: list[int]) -> list[int]:
        """Every rank holding a copy of a parameter tied across ``stages``, in every replica."""
        return sorted(self.rank(s, r) for s in stages for r in range(self.replicas))


def check_world_size(world: int, stages: int, replicas: int) -> None:
    if world != stages * replicas:
        hint = (f"launch {stages * replicas} processes (varuna-fx run --nproc "
                f"{stages * replicas} ...)")
        if world % stages == 0:
            hint += f", or compile with data_parallel={world // stages}"
        else:
            divisors = [p for p in range(1, world + 1) if world % p == 0]
            hint += f", or compile with stages= one of {divisors}"
        raise DistributedError(
            f"the world has {world} ranks but the plan needs P x D = {stages} x {replicas} = "
            f"{stages * replicas}: {hint}"
        )
