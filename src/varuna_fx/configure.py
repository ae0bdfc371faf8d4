"""Choosing P, D and the micro-batch size, and predicting the step time of a plan.

Given values are respected; missing ones get defaults here (the planner, which searches
configurations with the simulator, fills them in when it is available).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch.fx as fx

from .cluster import Cluster
from .errors import PlanError
from .plan import Plan
from .schedule import build_schedule, simulate


@dataclass
class Configuration:
    stages: int
    data_parallel: int
    micro_batch_size: int
    num_micro_batches: int
    pipeline_bandwidth: float
    allreduce_bandwidth: float
    in_flight: int
    alternatives: list[str] = field(default_factory=list)
    predictor: Callable[[Plan], float] | None = None

    def predict(self, plan: Plan) -> float:
        if self.predictor is not None:
            return self.predictor(plan)
        return predict_step_time(plan, self.pipeline_bandwidth, self.allreduce_bandwidth)


def pipeline_bandwidth(cluster: Cluster) -> float:
    """Consecutive stages of a replica sit on one node when it has room for more than one."""
    return cluster.intra_node_bandwidth if cluster.gpus_per_node > 1 else \
        cluster.inter_node_bandwidth


def allreduce_bandwidth(cluster: Cluster, stages: int, data_parallel: int) -> float:
    """Replicas of a stage are P ranks apart: on one node only if the whole job is."""
    if data_parallel > 1 and stages * data_parallel <= cluster.gpus_per_node:
        return cluster.intra_node_bandwidth
    return cluster.inter_node_bandwidth


def in_flight(schedule: str, stages: int, num_micro_batches: int) -> int:
    return min(stages, num_micro_batches) if schedule == "1f1b" else num_micro_batches


def replica_batch(example_batch: int, global_batch_size: int | None, data_parallel: int) -> int:
    if global_batch_size is None:
        return example_batch
    if global_batch_size % data_parallel:
        raise PlanError(
            f"global_batch_size={global_batch_size} is not divisible by the {data_parallel} "
            "data-parallel replicas; choose a multiple"
        )
    return global_batch_size // data_parallel


def default_micro_batch_size(batch: int, stages: int) -> int:
    """Enough micro-batches to keep the bubble small (about 4 per stage), dividing the batch."""
    want = min(batch, 4 * stages)
    for count in range(want, batch + 1):
        if batch % count == 0:
            return batch // count
    return 1


def choose_configuration(gm: fx.GraphModule, cluster: Cluster, *, example_batch: int,
                         global_batch_size: int | None, stages: int | None,
                         data_parallel: int | None, micro_batch_size: int | None,
                         schedule: str, recompute: bool) -> Configuration:
    del gm, recompute  # the planner uses them; the defaults do not
    p = stages or 1
    d = data_parallel or max(1, cluster.gpus // p)
    batch = replica_batch(example_batch, global_batch_size, d)
    if micro_batch_size is None:
        micro_batch_size = default_micro_batch_size(batch, p)
    check_micro_batch(batch, micro_batch_size)
    m = batch // micro_batch_size
    return Configuration(
        stages=p, data_parallel=d, micro_batch_size=micro_batch_size, num_micro_batches=m,
        pipeline_bandwidth=pipeline_bandwidth(cluster),
        allreduce_bandwidth=allreduce_bandwidth(cluster, p, d),
        in_flight=in_flight(schedule, p, m),
    )


def check_micro_batch(batch: int, micro_batch_size: int) -> None:
    if micro_batch_size < 1 or batch % micro_batch_size:
        raise PlanError(
            f"micro_batch_size={micro_batch_size} does not divide the per-replica batch of "
            f"{batch}; choose a divisor of {batch}"
        )


def predict_step_time(plan: Plan, bandwidth: float, ar_bandwidth: float) -> float:
    """Simulated pipeline time plus the data-parallel all-reduce of the slowest stage."""
    sched = build_schedule(plan.schedule, plan.stages, plan.num_micro_batches, plan.recompute)
    costs = plan.stage_costs
    sim = simulate(
        sched,
        forward=[s.forward_time for s in costs],
        backward=[s.backward_time for s in costs],
        recompute=[s.forward_time for s in costs] if plan.recompute else None,
        send_bytes=[s.boundary_bytes for s in costs[:-1]],
        bandwidth=bandwidth,
    )
    d = plan.data_parallel
    allreduce = max((2 * (d - 1) / d * s.parameter_bytes / ar_bandwidth for s in costs),
                    default=0.0) if d > 1 else 0.0
    return sim.step_time + allreduce
