"""Pipeline schedules: one registry entry per schedule (``registry.py``: Varuna, 1F1B, GPipe,
their split-backward variants, interleaved 1F1B, ZB-V and DualPipeV); generate, validate,
simulate and draw them; lower them to explicit sends and receives (``lowering.py``) and check
those against NCCL's rules (``nccl_check.py``).

>>> from varuna_fx.schedule import build_schedule, simulate
>>> sched = build_schedule("varuna", num_stages=4, num_micro_batches=8)
>>> simulate(sched, forward=[1.0] * 4, backward=[2.0] * 4).step_time
39.0
"""

from varuna_fx.schedule.actions import Action, Kind, Schedule
from varuna_fx.schedule.build import (
    build_schedule,
    clear_caches,
    recompute_per_stage,
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
from varuna_fx.schedule.registry import (
    AUTO,
    DEFAULT_SCHEDULE,
    SCHEDULES,
    ScheduleChoice,
    ScheduleSpec,
    depends_on_costs,
    is_split,
    resolve_schedule,
    schedule_choices,
    schedule_names,
    schedule_spec,
    split_base,
    virtual_choices,
    virtual_names,
    weighed_schedules,
)
from varuna_fx.schedule.render import gantt, text_grid
from varuna_fx.schedule.schedule_costs import ScheduleCosts
from varuna_fx.schedule.simulate import SimResult, analytic_bubble, simulate, simulate_costs
from varuna_fx.schedule.simulate_step import StepTiming, simulate_costs_step, simulate_step
from varuna_fx.schedule.structure import peak_stash, peak_stash_counts
from varuna_fx.schedule.validate import execution_order, validate

__all__ = [
    "AUTO",
    "DEFAULT_SCHEDULE",
    "LOOKAHEAD",
    "SCHEDULES",
    "Action",
    "analytic_bubble",
    "build_schedule",
    "chain_links",
    "check_comms",
    "check_schedule_comms",
    "clear_caches",
    "CommRun",
    "depends_on_costs",
    "execution_order",
    "gantt",
    "is_split",
    "Kind",
    "Link",
    "lower",
    "lower_schedule",
    "Lowered",
    "RankOp",
    "OpKind",
    "peak_stash",
    "peak_stash_counts",
    "RankProgram",
    "recompute_per_stage",
    "resolve_schedule",
    "Schedule",
    "schedule_choices",
    "schedule_names",
    "schedule_spec",
    "split_base",
    "ScheduleChoice",
    "ScheduleCosts",
    "ScheduleSpec",
    "SimResult",
    "simulate",
    "simulate_costs",
    "simulate_costs_step",
    "simulate_step",
    "StepTiming",
    "text_grid",
    "validate",
    "virtual_choices",
    "virtual_names",
    "walk",
    "weighed_schedules",
    "with_micro_batches",
]
