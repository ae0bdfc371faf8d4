"""Prove a schedule complete and deadlock-free, and derive one global execution order.

Completeness is checked per stage against the required action set; deadlock freedom by running
the schedule abstractly: any stage may execute the head of its list once the head's data
dependencies are done. If every stage is stuck while actions remain, the schedule would hang the
real runtime, and the error names what each stage waits for. With virtual stages the lists that
run in order are the ranks' (``Schedule.lists``): a rank waits at its head whichever of its
stages that belongs to, which is what makes an interleaved order deadlock or not.
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
        if not _stage_ok(schedule, s):
            _check_stage(schedule, s)  # raises, naming what is wrong
    if schedule.rank_lists is not None:
        _check_ranks(schedule)


def _check_ranks(schedule: Schedule) -> None:
    """A virtual schedule: each stage has a rank, each rank list holds only its stages'
    actions, and the per-stage lists are the ranks' orders of them."""
    ranks = schedule.stage_ranks or ()
    lists = schedule.rank_lists or []
    if len(ranks) != schedule.num_stages or sorted(set(ranks)) != list(range(len(lists))):
        raise ScheduleError(
            f"schedule placement {list(ranks)} must give each of the {schedule.num_stages} "
            f"stages one of the {len(lists)} ranks, every rank running some stage"
        )
    derived: list[list[Action]] = [[] for _ in range(schedule.num_stages)]
    for r, acts in enumerate(lists):
        for act in acts:
            if not 0 <= act.stage < schedule.num_stages or ranks[act.stage] != r:
                where = ranks[act.stage] if 0 <= act.stage < schedule.num_stages else "none"
                raise ScheduleError(
                    f"rank {r}'s list contains {act}, whose stage runs on rank {where}"
                )
            derived[act.stage].append(act)
    if derived != schedule.per_stage:
        raise ScheduleError("the per-stage lists differ from the ranks' lists: build a virtual "
                            "schedule with Schedule.virtual")

def _deadlock_message(schedule: Schedule, heads: list[int], done: set[Action]) -> str:
    waits = []
    label = "stage" if schedule.rank_lists is None else "rank"
    for s, h in enumerate(heads):
        if h < len(schedule.lists[s]):
            act = schedule.lists[s][h]
            needs = [str(d) for d in dependencies(act, schedule) if d not in done]
            waits.append(f"{label} {s} waits at {act} (needs {', '.join(needs)})")
    return "deadlock: " + ", ".join(waits)


def execution_order(schedule: Schedule) -> list[Action]:
    """One global order respecting every stage's (rank's) list and every data dependency.

    Round-robin over stages, taking as many ready head actions from each as possible; the
    one-process runtime executes actions in exactly this order. Raises on deadlock.
    """
    return ordered_ids(schedule)[0]


_SLOT = {Kind.F: 0, Kind.R: 1, Kind.B: 2, Kind.W: 3}


def action_id(stage: int, kind: Kind, mb: int, m: int) -> int:
    """A dense integer for ``Action(stage, kind, mb)`` (``4 * m`` per stage): the simulator
    and the checks index lists with it instead of hashing Action objects, which at P=56,
    m=64 (10^4 actions, dozens of schedules per planner search) took seconds."""
    return (stage * 4 + _SLOT[kind]) * m + mb


def _stage_ok(schedule: Schedule, stage: int) -> bool:
    """:func:`_check_stage`'s conditions on integers (True: nothing to report)."""
    m = schedule.num_micro_batches
    need = [True, schedule.recomputes(stage), True, schedule.split_backward]
    pos = [-1] * (4 * m)
    for k, act in enumerate(schedule.per_stage[stage]):
        i = act.mb
        if act.stage != stage or not 0 <= i < m:
            return False
        slot = _SLOT[act.kind]
        if not need[slot] or pos[slot * m + i] >= 0:
            return False
        pos[slot * m + i] = k
    for i in range(m):
        last = -1
        for slot in range(4):
            at = pos[slot * m + i]
            if need[slot]:
                if at < last:  # missing (-1) or out of F, R, B, W order
                    return False
                last = at
    return True


def ordered_ids(schedule: Schedule) -> tuple[list[Action], list[int]]:
    """:func:`execution_order` and the :func:`action_id` of each of its actions."""
    _check_shape(schedule)
    p, m = schedule.num_stages, schedule.num_micro_batches
    size = 4 * m * p
    done = bytearray(size + 1)
    done[size] = 1  # the "no dependency" slot
    ids: list[list[int]] = []
    first: list[list[int]] = []
    second: list[list[int]] = []
    stash = [1 if schedule.recomputes(s) else 0 for s in range(p)]  # B's own-stage input
    lists = schedule.lists
    for acts in lists:
        own, d1, d2 = [], [], []
        for act in acts:
            s, i, slot = act.stage, act.mb, _SLOT[act.kind]
            if not (0 <= s < p and 0 <= i < m):
                return _slow_order(schedule)
            here = s * 4 * m + i  # this stage's F of micro-batch i; + slot * m for the others
            own.append(here + slot * m)
            if slot == 0:  # F: the upstream F
                d1.append(here - 4 * m if s > 0 else size)
                d2.append(size)
            elif slot == 1:  # R: replays this stage's F
                d1.append(here)
                d2.append(size)
            elif slot == 3:  # W: after this stage's B
                d1.append(here + 2 * m)
                d2.append(size)
            elif s == p - 1:  # B on the last stage: its own F
                d1.append(here)
                d2.append(size)
            else:  # B: the downstream B and this stage's R (or F)
                d1.append(here + 4 * m + 2 * m)
                d2.append(here + stash[s] * m)
        ids.append(own)
        first.append(d1)
        second.append(d2)
    heads = [0] * len(lists)
    order: list[Action] = []
    order_ids: list[int] = []
    total = sum(len(acts) for acts in lists)
    while len(order) < total:
        progressed = False
        for s, acts in enumerate(lists):
            h, n = heads[s], len(acts)
            own, d1, d2 = ids[s], first[s], second[s]
            while h < n and done[d1[h]] and done[d2[h]]:
                done[own[h]] = 1
                order.append(acts[h])
                order_ids.append(own[h])
                h += 1
            if h != heads[s]:
                heads[s] = h
                progressed = True
        if not progressed:
            names = {a for a, k in zip(order, order_ids) if done[k]}
            raise ScheduleError(_deadlock_message(schedule, heads, names))
    return order, order_ids


def _slow_order(schedule: Schedule) -> tuple[list[Action], list[int]]:
    """Actions outside the schedule's stages or micro-batches (an invalid schedule, which
    ``check_complete`` reports): the order by Action objects, as before."""
    lists = schedule.lists
    heads = [0] * len(lists)
    done: set[Action] = set()
    order: list[Action] = []
    total = sum(len(acts) for acts in lists)
    while len(order) < total:
        progressed = False
        for s, acts in enumerate(lists):
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
    return order, [-1] * len(order)


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is complete and deadlock-free."""
    check_complete(schedule)
    execution_order(schedule)
