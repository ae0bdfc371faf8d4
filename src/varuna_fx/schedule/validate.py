"""Prove a schedule complete and deadlock-free, and derive one global execution order.

Completeness is checked per stage against the required action set; deadlock freedom by running
the schedule abstractly: any stage may execute the head of its list once the head's data
dependencies are done. If every stage is stuck while actions remain, the schedule would hang the
real runtime, and the error names what each stage waits for.
"""

from __future__ import annotations

from varuna_fx.errors import ScheduleError
from varuna_fx.schedule.actions import Action, Kind, Schedule


def dependencies(action: Action, schedule: Schedule) -> list[Action]:
    """Actions whose results ``action`` consumes (the edges the runtime enforces)."""
    s, i = action.stage, action.mb
    last = schedule.num_stages - 1
    if action.kind is Kind.F:
        return [Action(s - 1, Kind.F, i)] if s > 0 else []
    if action.kind is Kind.R:
        return [Action(s, Kind.F, i)]  # replays the forward from the stashed stage inputs
    if action.kind is Kind.W:
        return [Action(s, Kind.B, i)]  # weight gradients reuse the input-gradient pass's graph
    if s == last:
        return [Action(s, Kind.F, i)]  # the last stage kept its activations
    deps = [Action(s + 1, Kind.B, i)]
    deps.append(Action(s, Kind.R, i) if schedule.recomputes(s) else Action(s, Kind.F, i))
    return deps


def required_actions(schedule: Schedule, stage: int) -> set[Action]:
    """Every action stage ``stage`` must run exactly once."""
    kinds = [Kind.F, Kind.B]
    if schedule.recomputes(stage):
        kinds.append(Kind.R)
    if schedule.split_backward:
        kinds.append(Kind.W)
    return {Action(stage, k, i) for k in kinds for i in range(schedule.num_micro_batches)}


def _check_shape(schedule: Schedule) -> None:
    if schedule.num_stages < 1 or schedule.num_micro_batches < 1:
        raise ScheduleError(
            f"schedule needs P >= 1 and m >= 1, got P={schedule.num_stages} "
            f"m={schedule.num_micro_batches}"
        )
    if len(schedule.per_stage) != schedule.num_stages:
        raise ScheduleError(
            f"schedule has {len(schedule.per_stage)} stage lists but P={schedule.num_stages}"
        )


def _check_stage(schedule: Schedule, stage: int) -> None:
    """Stage ``stage`` runs exactly its required actions, each F before its R before its B
    before its W."""
    acts = schedule.per_stage[stage]
    position: dict[Action, int] = {}
    for pos, act in enumerate(acts):
        if act.stage != stage:
            raise ScheduleError(
                f"stage {stage}'s list contains {act}, which belongs to stage {act.stage}"
            )
        if act in position:
            raise ScheduleError(f"stage {stage} runs {act} twice")
        position[act] = pos
    required = required_actions(schedule, stage)
    missing = sorted(required - position.keys())
    extra = sorted(position.keys() - required)
    if missing:
        raise ScheduleError(f"stage {stage} is missing {' '.join(map(str, missing))}")
    if extra:
        raise ScheduleError(f"stage {stage} has unexpected {' '.join(map(str, extra))}")
    for i in range(schedule.num_micro_batches):
        chain = [Action(stage, k, i) for k in (Kind.F, Kind.R, Kind.B, Kind.W)]
        chain = [a for a in chain if a in position]
        for before, after in zip(chain, chain[1:]):
            if position[before] > position[after]:
                raise ScheduleError(f"stage {stage}: {after} comes before {before}")


def check_complete(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless every stage holds exactly its required actions."""
    _check_shape(schedule)
    if not isinstance(schedule.recompute, bool) and len(schedule.recompute) != schedule.num_stages:
        raise ScheduleError(
            f"schedule has {len(schedule.recompute)} per-stage recompute flags but "
            f"P={schedule.num_stages}"
        )
    for s in range(schedule.num_stages):
        _check_stage(schedule, s)


def _deadlock_message(schedule: Schedule, heads: list[int], done: set[Action]) -> str:
    waits = []
    for s, h in enumerate(heads):
        if h < len(schedule.per_stage[s]):
            act = schedule.per_stage[s][h]
            needs = [str(d) for d in dependencies(act, schedule) if d not in done]
            waits.append(f"stage {s} waits at {act} (needs {', '.join(needs)})")
    return "deadlock: " + ", ".join(waits)


def execution_order(schedule: Schedule) -> list[Action]:
    """One global order respecting every stage's list and every data dependency.

    Round-robin over stages, taking as many ready head actions from each as possible; the
    one-process runtime executes actions in exactly this order. Raises on deadlock.
    """
    _check_shape(schedule)
    heads = [0] * schedule.num_stages
    done: set[Action] = set()
    order: list[Action] = []
    total = sum(len(acts) for acts in schedule.per_stage)
    while len(order) < total:
        progressed = False
        for s, acts in enumerate(schedule.per_stage):
            while heads[s] < len(acts):
                act = acts[heads[s]]
                if any(d not in done for d in dependencies(act, schedule)):
                    break
                done.add(act)
                order.append(act)
                heads[s] += 1
                progressed = True
        if not progressed:
            raise ScheduleError(_deadlock_message(schedule, heads, done))
    return order


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is complete and deadlock-free."""
    check_complete(schedule)
    execution_order(schedule)
