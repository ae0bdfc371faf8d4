"""Schedule generators: GPipe, 1F1B (PipeDream-flush) and Varuna, behind one registry.

A generator is a function ``(num_stages, num_micro_batches, recompute) -> per-stage lists``;
:func:`build_schedule` looks it up in :data:`SCHEDULES`, so a new policy is one function plus one
registry entry. Recompute convention shared by all generators: every stage but the last has one
``R`` per micro-batch before its ``B``; the last stage keeps its activations and never recomputes.
"""

from __future__ import annotations

from collections.abc import Callable

from varuna_fx.errors import ScheduleError
from varuna_fx.schedule.actions import Action, Kind, Schedule
from varuna_fx.schedule.varuna import varuna_order

StageLists = list[list[Action]]
ScheduleFn = Callable[[int, int, bool], StageLists]


def _backward(stage: int, mb: int, recompute_here: bool) -> list[Action]:
    """The backward of one micro-batch, preceded by its recompute where one is needed."""
    if recompute_here:
        return [Action(stage, Kind.R, mb), Action(stage, Kind.B, mb)]
    return [Action(stage, Kind.B, mb)]


def gpipe(num_stages: int, num_micro_batches: int, recompute: bool) -> StageLists:
    """All forwards, then all backwards (each just after its recompute), micro-batch order."""
    per_stage: StageLists = []
    for s in range(num_stages):
        rc = recompute and s < num_stages - 1
        acts = [Action(s, Kind.F, i) for i in range(num_micro_batches)]
        for i in range(num_micro_batches):
            acts += _backward(s, i, rc)
        per_stage.append(acts)
    return per_stage


def one_f_one_b(num_stages: int, num_micro_batches: int, recompute: bool) -> StageLists:
    """PipeDream-flush / Megatron 1F1B: warm-up forwards, steady F/B pairs, cool-down backwards.

    Stage ``s`` keeps at most ``P - s`` micro-batches in flight, which is what bounds its
    activation stash; the recompute (if any) sits right before each backward, on the critical path.
    """
    m = num_micro_batches
    per_stage: StageLists = []
    for s in range(num_stages):
        rc = recompute and s < num_stages - 1
        warmup = min(num_stages - s - 1, m)
        acts = [Action(s, Kind.F, i) for i in range(warmup)]
        for i in range(m - warmup):
            acts.append(Action(s, Kind.F, warmup + i))
            acts += _backward(s, i, rc)
        for i in range(m - warmup, m):
            acts += _backward(s, i, rc)
        per_stage.append(acts)
    return per_stage


def varuna(num_stages: int, num_micro_batches: int, recompute: bool) -> StageLists:
    """Varuna's opportunistic schedule (Athlur et al., EuroSys'22); see ``varuna.py``."""
    return varuna_order(num_stages, num_micro_batches, recompute)


# Name -> generator. Add an entry here to make a new policy available everywhere.
SCHEDULES: dict[str, ScheduleFn] = {
    "varuna": varuna,
    "1f1b": one_f_one_b,
    "gpipe": gpipe,
}


def build_schedule(
    name: str, num_stages: int, num_micro_batches: int, recompute: bool = True
) -> Schedule:
    """Generate the schedule ``name`` for ``num_stages`` stages and ``num_micro_batches``."""
    if name not in SCHEDULES:
        choices = ", ".join(sorted(SCHEDULES))
        raise ScheduleError(f"unknown schedule {name!r}; valid choices are: {choices}")
    if num_stages < 1:
        raise ScheduleError(f"num_stages must be >= 1, got {num_stages}")
    if num_micro_batches < 1:
        raise ScheduleError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    per_stage = SCHEDULES[name](num_stages, num_micro_batches, recompute)
    return Schedule(name, num_stages, num_micro_batches, recompute, per_stage)


def with_micro_batches(schedule: Schedule, num_micro_batches: int) -> Schedule:
    """``schedule`` itself when it has ``num_micro_batches``, else the same kind of schedule
    (same generator, stages and recompute) for that many: a one-process pipeline accepts any
    batch the micro-batch size divides."""
    if schedule.num_micro_batches == num_micro_batches:
        return schedule
    return build_schedule(schedule.name, schedule.num_stages, num_micro_batches,
                          schedule.recompute)
