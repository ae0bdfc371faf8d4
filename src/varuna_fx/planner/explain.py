"""When no configuration fits: the smallest memory per device that would, as a PlanError."""

from __future__ import annotations

import math

from ..costs.memory import format_bytes, format_bytes_apart
from ..errors import PlanError
from .candidates import Candidate, Space
from .search import Planner


def smallest_memory(planner: Planner, c: Candidate) -> float:
    """The least memory per device for which ``c`` finds a fitting partition: the largest
    stage of the partition whose largest stage is smallest (the greedy's and the memory
    model's, so ``Pricer.fit`` succeeds with it)."""
    pricer = planner.pricer
    least = math.inf
    for kind in pricer.schedules:  # schedule="auto": the least over all it weighs
        _, counts = pricer.built(c.stages, c.num_micro_batches, kind)
        plan = pricer.balancer(c.micro_batch_size).min_memory_partition(c.stages, counts)
        if plan is None:
            continue
        need = float(plan.memory(counts, pricer.recompute).max())
        if need < least and pricer.fit(c, counts, need):
            least = need
    return least


def no_candidates(space: Space) -> str:
    fixed = ", ".join(f"{k}={v}" for k, v in (
        ("stages", space.stages), ("data_parallel", space.data_parallel),
        ("micro_batch_size", space.micro_batch_size),
        ("grad_accum_steps", space.micro_batches)) if v is not None)
    devices = f"exactly the {space.world} running ranks" if space.world else \
        f"at most {space.gpus} devices"
    batch = f"global_batch_size={space.global_batch_size}" if space.global_batch_size \
        else f"the example batch of {space.example_batch} per replica"
    return (f"no (P, D, micro-batch size) uses {devices} with {batch}"
            + (f" and {fixed}" if fixed else "") + ": P x D must fit the devices, D divide the "
            "global batch and the micro-batch size (or grad_accum_steps, the micro-batches) "
            "divide the per-replica batch; change the fixed values or the batch")


def explain_nothing_fits(planner: Planner, space: Space) -> PlanError:
    """The smallest memory per device any candidate would need, as a PlanError."""
    pool = planner.candidates(space)
    if not pool:
        return PlanError(no_candidates(space))
    # memory falls with more stages, smaller micro-batches and fewer micro-batches in flight
    tried = []
    for p in sorted({c.stages for c in pool})[-3:]:
        group = [c for c in pool if c.stages == p]
        c = min(group, key=lambda x: (x.micro_batch_size, x.num_micro_batches))
        tried.append((smallest_memory(planner, c), c))
    need, c = min(tried, key=lambda t: t[0])
    if not math.isfinite(need):
        have = format_bytes(planner.pricer.memory_cap)
        return PlanError(f"no configuration of P, D and micro-batch size fits in {have} per "
                         "device; use devices with more memory or a smaller model")
    have, needed = format_bytes_apart(planner.pricer.memory_cap, need)
    options = [f"devices with at least {format_bytes(need, up=True)}", "more devices",
               "a smaller global batch"]
    if not planner.pricer.recompute:  # only suggest what is not already on
        options.append("recompute=True")
    return PlanError(
        f"no configuration of P, D and micro-batch size fits in {have} per device: the "
        f"smallest needs {needed} per device (P={c.stages}, D={c.data_parallel}, "
        f"micro-batch {c.micro_batch_size}). Use {', '.join(options[:-1])} or {options[-1]}"
    )

