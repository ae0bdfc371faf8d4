"""Per-stage totals for the plan table and the simulator."""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx as fx

from ..costs.memory import OPTIMIZER_COPIES
from ..costs.roofline import backward_time, forward_time
from ..ir.nodes import info
from ..passes.assign_stages import CostSetting, canonical_parameters
from ..passes.partition import Partition
from ..planner.plan import StageCost
from .stage_module import Stage


def stage_totals(gm: fx.GraphModule, stages: list[Stage], partition: Partition,
                setting: CostSetting, memory: Sequence[float]) -> list[StageCost]:
    """``memory``: bytes per stage by the planner's memory model (``configure.price``), the one
    the alternatives were weighed with, so the table and its alternatives row agree."""
    b = setting.micro_batch_size
    by_name = {n.name: n for n in gm.graph.nodes}
    # parameters only (buffers are not parameters), under the annotations' names
    sizes = {name: p.numel() for name, p in canonical_parameters(gm).items()}
    trainable = {name for name, p in gm.named_parameters(remove_duplicate=False)
                 if p.requires_grad}
    result = []
    for stage in stages:
        nodes = [by_name[n] for n in stage.spec.nodes]
        held: dict[str, int] = {}
        for n in stage.module.graph.nodes:
            held.update(info(n).params)
        fwd = sum(forward_time(info(n), b, setting.device) for n in nodes)
        bwd = sum(backward_time(info(n), b, setting.device) for n in nodes)
        result.append(StageCost(
            index=stage.index,
            nodes=len(nodes),
            parameters=sum(sizes.get(name, 0) for name in held),
            parameter_bytes=sum(held.values()),
            flops=sum(info(n).flops(b) for n in nodes),
            activation_bytes=sum(info(n).out_bytes(b) for n in nodes
                                 if info(n).fwd_flops(b) > 0),
            boundary_bytes=sum(t.nbytes(b) for t in stage.spec.sends),
            time=partition.stage_times[stage.index],
            memory=float(memory[stage.index]),
            forward_time=fwd,
            backward_time=bwd,
            # the optimizer's state (Adam's moments) for the weights it reads, on each rank
            optimizer_bytes=OPTIMIZER_COPIES * sum(v for k, v in held.items() if k in trainable)
            / setting.optimizer_shards,
        ))
    return result
