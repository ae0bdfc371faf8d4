"""Pipeline schedules: generate (Varuna, 1F1B, GPipe, and their split-backward variants), validate,
simulate and draw them; lower them to explicit sends and receives (``lowering.py``) and check
those against NCCL's rules (``nccl_check.py``).

>>> from varuna_fx.schedule import build_schedule, simulate
>>> sched = build_schedule("varuna", num_stages=4, num_micro_batches=8)
>>> simulate(sched, forward=[1.0] * 4, backward=[2.0] * 4).step_time
39.0
"""

from varuna_fx.schedule.actions import Action, Kind, Schedule
from varuna_fx.schedule.generators import (
    SCHEDULES,
    build_schedule,
    cheaper,
    check_schedule_name,
    clear_caches,
    default_stages_per_rank,
    depends_on_costs,
    has_quick,
    is_split,
    recompute_per_stage,
    schedule_names,
    with_micro_batches,
)
from varuna_fx.schedule.lowering import (
    LOOKAHEAD,
    Link,
    Lowered,
    OpKind,
    RankOp,
    RankProgram,
    chain_links,
    lower,
    lower_schedule,
    walk,
)
from varuna_fx.schedule.nccl_check import CommRun, check_comms, check_schedule_comms
from varuna_fx.schedule.render import gantt, text_grid
from varuna_fx.schedule.schedule_costs import ScheduleCosts
from varuna_fx.schedule.simulate import SimResult, analytic_bubble, simulate, simulate_costs
from varuna_fx.schedule.simulate_step import StepTiming, simulate_costs_step, simulate_step
from varuna_fx.schedule.structure import peak_stash, peak_stash_counts
from varuna_fx.schedule.validate import execution_order, validate
from varuna_fx.schedule.virtual import is_virtual, placement_style, virtual_names

__all__ = [
    "LOOKAHEAD",
    "Action",
    "CommRun",
    "Link",
    "Lowered",
    "RankOp",
    "OpKind",
    "RankProgram",
    "Kind",
    "SCHEDULES",
    "Schedule",
    "ScheduleCosts",
    "SimResult",
    "StepTiming",
    "analytic_bubble",
    "build_schedule",
    "chain_links",
    "check_comms",
    "check_schedule_comms",
    "cheaper",
    "check_schedule_name",
    "clear_caches",
    "default_stages_per_rank",
    "depends_on_costs",
    "execution_order",
    "gantt",
    "has_quick",
    "is_split",
    "is_virtual",
    "lower",
    "lower_schedule",
    "peak_stash",
    "peak_stash_counts",
    "placement_style",
    "recompute_per_stage",
    "schedule_names",
    "simulate",
    "simulate_costs",
    "simulate_costs_step",
    "simulate_step",
    "text_grid",
    "validate",
    "virtual_names",
    "walk",
    "with_micro_batches",
]
