"""Choosing P, D and the micro-batch size, and predicting the step time of a plan.

Given values are respected; the planner (``varuna_fx.planner.search``) chooses the missing ones
by simulating every candidate with measured (profile) or FLOP-estimated costs. In a running
distributed job P x D must use exactly its ranks. Two cases have nothing to search and keep the
given P with about four micro-batches per stage: a single device asked to run an explicit
number of stages (a notebook, a test: the stages share the device), and explicit values that
cannot match the running ranks (the runtime then says what to launch instead).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch.fx as fx

from .cluster import Cluster
from .costmodel import DeviceSpec, NodeTimes
from .errors import PartitionError, PlanError, env_int
from .ir import info
from .passes.assign_stages import compute_nodes
from .plan import Alternative, Plan
from .schedule import build_schedule, simulate

if TYPE_CHECKING:
    from .planner.profile import Profile
    from .planner.search import Planner


@dataclass
class Configuration:
    stages: int
    data_parallel: int
    micro_batch_size: int
    num_micro_batches: int
    pipeline_bandwidth: float
    allreduce_bandwidth: float
    in_flight: int
    alternatives: list[Alternative] = field(default_factory=list)
    predictor: Callable[[Plan], float] | None = None
    device: DeviceSpec | None = None  # what time estimates are made for
    node_times: NodeTimes | None = None  # measured costs, when a profile applies

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


def in_flight(schedule: str, stages: int, num_micro_batches: int, recompute: bool = True) -> int:
    """Most micro-batches any stage stashes at once under the schedule."""
    from .planner.search import stash_counts

    return max(stash_counts(build_schedule(schedule, stages, num_micro_batches, recompute)))


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
                         schedule: str, recompute: bool, profile: Profile | None = None
                         ) -> Configuration:
    """``profile``: measured costs (``varuna_fx.planner.Profile``), or None for estimates."""
    from .planner.explain import explain_nothing_fits
    from .planner.search import Space

    if stages is not None:  # before any schedule is built: 10**6 stages would take minutes
        operations = len(compute_nodes(gm))
        if stages > operations:
            raise PartitionError(f"stages={stages} is more than the {operations} operations of "
                                 f"the model: use at most {operations} stages")
    planner = _planner(gm, cluster, schedule, recompute, profile)
    alternatives: list[Alternative] = []
    world = _running_world()
    # explicit values that cannot match the running ranks: the runtime says what to launch
    mismatch = world is not None and stages is not None and (
        world % stages != 0 or (data_parallel is not None and stages * data_parallel != world))
    if stages is not None and (cluster.gpus == 1 or mismatch):  # nothing to search
        p, d = stages, data_parallel or max(1, cluster.gpus // stages)
        batch = replica_batch(example_batch, global_batch_size, d)
        b = micro_batch_size or default_micro_batch_size(batch, p)
        check_micro_batch(batch, b)
    else:
        space = Space(cluster.gpus, example_batch, global_batch_size, stages, data_parallel,
                      micro_batch_size, world=world)
        result = planner.search(space)
        if not result.top:
            raise explain_nothing_fits(planner, space)
        best = result.best
        p, d, b = best.stages, best.data_parallel, best.micro_batch_size
        alternatives = result.alternatives
    m = replica_batch(example_batch, global_batch_size, d) // b
    net = planner.links(p, d)
    return Configuration(
        stages=p, data_parallel=d, micro_batch_size=b, num_micro_batches=m,
        pipeline_bandwidth=net.partition_bandwidth, allreduce_bandwidth=net.allreduce_bandwidth,
        in_flight=max(planner.built(p, m)[1]), alternatives=alternatives,
        predictor=lambda plan: _predict(planner, gm, plan), device=planner.spec,
        node_times=planner.table.measured,
    )


def _planner(gm: fx.GraphModule, cluster: Cluster, schedule: str, recompute: bool,
             profile: Profile | None) -> Planner:
    """Costs measured by ``profile`` when it was made on this kind of device, else estimated
    from FLOPs for the cluster's devices."""
    from .planner.costs import CostTable
    from .planner.search import Planner

    table = CostTable.build(gm)
    network = None
    if profile is not None:
        if profile.applies_to(cluster):
            table.measured = profile.measured_times(table)
            network = profile.network
        else:
            warnings.warn(f"the profile was measured on {profile.device!r}, the cluster has "
                          f"{cluster.kind!r} devices: planning with FLOP estimates instead",
                          stacklevel=4)
    return Planner(table, cluster, schedule=schedule, recompute=recompute, network=network)


def _running_world() -> int | None:
    """In a distributed run every launched rank must get a (stage, replica)."""
    from .runtime.setup import launched_distributed

    if not launched_distributed():
        return None
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else env_int("WORLD_SIZE", 1, minimum=1)


def _predict(planner: Planner, gm: fx.GraphModule, plan: Plan) -> float:
    """Simulate the partition the partition pass made (its stages are in node.meta), and note
    the result on the chosen row of the alternatives."""
    from .planner.balance import Balancer
    from .planner.search import Candidate

    stage = np.array([info(n).stage for n in compute_nodes(gm)])
    bounds = np.concatenate([[0], np.flatnonzero(np.diff(stage)) + 1, [len(stage)]])
    b, p = plan.micro_batch_size, plan.stages
    units = planner.table.unit_arrays(b, planner.spec, positions=bounds)
    balancer = Balancer(units, planner.table.shared, planner.links(p, 1).partition_bandwidth,
                        planner.recompute)
    c = Candidate(p, plan.data_parallel, b, plan.num_micro_batches)
    c.plan = balancer.stage_plan(list(range(p + 1)))
    sched, counts = planner.built(p, plan.num_micro_batches)
    step = planner.simulated(c, sched)
    c.memory = tuple(float(x) for x in c.plan.memory(counts, planner.recompute))
    plan.alternatives = [c.alternative(True) if a.chosen else a for a in plan.alternatives]
    return step


def check_micro_batch(batch: int, micro_batch_size: int) -> None:
    if micro_batch_size < 1 or batch % micro_batch_size:
        raise PlanError(
            f"micro_batch_size={micro_batch_size} does not divide the per-replica batch of "
            f"{batch}; choose a divisor of {batch}"
        )


def predict_step_time(plan: Plan, bandwidth: float, ar_bandwidth: float) -> float:
    """Simulated pipeline time plus the data-parallel all-reduce of the slowest stage (from the
    plan's per-stage estimates; the planner's predictor replaces it)."""
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

