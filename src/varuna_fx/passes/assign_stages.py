"""assign_stages: turn the annotated graph into cost arrays, partition, record each node's stage.

The partitioner (``partition.py``) sees only arrays; this pass is the bridge. Positions are the
non-replicable compute nodes in graph (topological) order. A value produced at position ``p``
and last used at ``q`` (the output node counts as position N, on the last stage) crosses every
cut between them; a value that is not a single tensor (a tuple, an int computed from an
activation) may not cross, so those cuts are forbidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch.fx as fx

from ..costmodel import DeviceSpec, NodeTimes, step_time
from ..ir import info
from .partition import Partition, PartitionCosts, partition

# Weights, their gradients and Adam's two moments, all in the parameters' dtype.
WEIGHT_COPIES = 4


@dataclass(frozen=True)
class CostSetting:
    micro_batch_size: int
    device: DeviceSpec
    bandwidth: float  # bytes/s between neighbouring stages
    memory_cap: float  # bytes per device
    in_flight: int  # micro-batches stashed at once on a stage
    recompute: bool | str  # True | False | "auto": per stage, only where it must (partition)
    # Measured costs (a planner profile) replacing the FLOP-based estimates when given.
    node_times: NodeTimes | None = None


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes
            if n.op not in ("placeholder", "get_attr", "output") and not info(n).replicable]


def params_read(node: fx.Node) -> dict[str, int]:
    """Parameters/buffers a node reads itself or through replicable inputs (get_attr, views)."""
    found: dict[str, int] = {}
    todo = [node]
    while todo:
        current = todo.pop()
        meta = info(current)
        found.update(meta.params)
        todo.extend(i for i in current.all_input_nodes if info(i).replicable)
    return found


def trainable_names(gm: fx.GraphModule) -> set[str]:
    """Parameters with gradients: they carry WEIGHT_COPIES; buffers and frozen weights one."""
    return {name for name, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}


def partition_costs(gm: fx.GraphModule, setting: CostSetting) -> PartitionCosts:
    nodes = compute_nodes(gm)
    n = len(nodes)
    position = {node: i for i, node in enumerate(nodes)}
    b = setting.micro_batch_size
    def times(recompute: bool) -> np.ndarray:
        if setting.node_times is not None:
            return np.asarray(setting.node_times.step_times(nodes, b, recompute), float)
        return np.array([step_time(info(x), b, setting.device, recompute) for x in nodes])

    compute = times(bool(setting.recompute))
    # the last stage never recomputes: its forward is followed directly by its backward
    last_compute = times(False) if setting.recompute else None
    weights = np.zeros(n)
    seen: set[str] = set()
    trainable = trainable_names(gm)
    for i, node in enumerate(nodes):  # a weight counts where it is first read
        for name, nbytes in params_read(node).items():
            if name not in seen:
                seen.add(name)
                weights[i] += (WEIGHT_COPIES if name in trainable else 1) * nbytes
    if setting.node_times is not None:
        activations = np.asarray(setting.node_times.activation_bytes(nodes, b), float)
    else:
        activations = np.array([
            info(x).out_bytes(b) if (info(x).fwd_flops(b) > 0) else 0.0 for x in nodes
        ])
    crossing = np.zeros(n + 2)
    forbidden = np.zeros(n + 2)
    for node in nodes:
        p = position[node]
        last = max((position.get(u, n) if u.op != "output" else n) for u in node.users) \
            if node.users else p
        if last <= p:
            continue
        # crosses cuts p+1 .. last
        if info(node).is_tensor:
            crossing[p + 1] += info(node).out_bytes(b)
            crossing[last + 1] -= info(node).out_bytes(b)
        else:
            forbidden[p + 1] += 1
            forbidden[last + 1] -= 1
    cut = np.cumsum(crossing)[: n + 1]
    cut[np.cumsum(forbidden)[: n + 1] > 0] = np.inf
    cut[0] = cut[n] = 0.0
    return PartitionCosts(
        compute=compute, weight_bytes=weights, activation_bytes=activations, cut_bytes=cut,
        bandwidth=setting.bandwidth, memory_cap=setting.memory_cap,
        in_flight=setting.in_flight, recompute=setting.recompute,
        last_stage_compute=last_compute,
    )


def assign_stages(gm: fx.GraphModule, num_stages: int, setting: CostSetting) -> Partition:
    costs = partition_costs(gm, setting)
    result = partition(costs, num_stages)
    for i, node in enumerate(compute_nodes(gm)):
        info(node).stage = result.stage_of(i)
    return result
