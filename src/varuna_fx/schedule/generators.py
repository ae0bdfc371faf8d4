"""Schedule generators: GPipe, 1F1B (PipeDream-flush) and Varuna, behind one registry.

A generator is a function ``(num_stages, num_micro_batches, recompute, costs) -> per-stage
lists``, where ``recompute`` has one bool per stage and ``costs`` are the per-stage times
(:class:`ScheduleCosts`) that cost-aware generators order by; :func:`build_schedule` looks it up
in :data:`SCHEDULES`, so a new policy is one function plus one registry entry. Recompute
convention shared by all generators: every stage that recomputes has one ``R`` per micro-batch
before its ``B``; the last stage keeps its activations and never recomputes.

Every base schedule has a split-backward variant named ``<base>-zb`` (``varuna-zb``,
``1f1b-zb``, ``gpipe-zb``): the same order with each backward cut into its input-gradient part
``B`` and a weight-gradient part ``W`` that fills idle time (``split.py``).

Schedules whose ranks run several stages (``interleaved-1f1b``, ``zbv``: ``virtual.py``) have
their own registry, ``VIRTUAL_SCHEDULES``; :func:`build_schedule` takes their
``stages_per_rank``. They are not in :func:`schedule_names` (whose schedules run any P).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from varuna_fx.errors import ScheduleError
from varuna_fx.schedule import placement as placement_module
from varuna_fx.schedule import split as split_module
from varuna_fx.schedule import varuna as varuna_module
from varuna_fx.schedule.actions import Action, Kind, Schedule
from varuna_fx.schedule.schedule_costs import ScheduleCosts
from varuna_fx.schedule.split import split_backward
from varuna_fx.schedule.varuna import QUICK_VARIANTS, ROUGH_VARIANTS, varuna_order
from varuna_fx.schedule.virtual import (
    DEFAULT_STAGES_PER_RANK,
    VIRTUAL_SCHEDULES,
    is_virtual,
    virtual_names,
)

StageLists = list[list[Action]]
ScheduleFn = Callable[[int, int, Sequence[bool], ScheduleCosts], StageLists]
SPLIT_SUFFIX = "-zb"


def _backward(stage: int, mb: int, recompute_here: bool) -> list[Action]:
    """The backward of one micro-batch, preceded by its recompute where one is needed."""
    if recompute_here:
        return [Action(stage, Kind.R, mb), Action(stage, Kind.B, mb)]
    return [Action(stage, Kind.B, mb)]


def gpipe(num_stages: int, num_micro_batches: int, recompute: Sequence[bool],
          costs: ScheduleCosts) -> StageLists:
    """All forwards, then all backwards (each just after its recompute), micro-batch order."""
    per_stage: StageLists = []
    for s in range(num_stages):
        acts = [Action(s, Kind.F, i) for i in range(num_micro_batches)]
        for i in range(num_micro_batches):
            acts += _backward(s, i, recompute[s])
        per_stage.append(acts)
    return per_stage


def one_f_one_b(num_stages: int, num_micro_batches: int, recompute: Sequence[bool],
                costs: ScheduleCosts) -> StageLists:
    """PipeDream-flush / Megatron 1F1B: warm-up forwards, steady F/B pairs, cool-down backwards.

    Stage ``s`` keeps at most ``P - s`` micro-batches in flight, which is what bounds its
    activation stash; the recompute (if any) sits right before each backward, on the critical path.
    """
    m = num_micro_batches
    per_stage: StageLists = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, m)
        acts = [Action(s, Kind.F, i) for i in range(warmup)]
        for i in range(m - warmup):
            acts.append(Action(s, Kind.F, warmup + i))
            acts += _backward(s, i, recompute[s])
        for i in range(m - warmup, m):
            acts += _backward(s, i, recompute[s])
        per_stage.append(acts)
    return per_stage


def varuna(num_stages: int, num_micro_batches: int, recompute: Sequence[bool],
           costs: ScheduleCosts) -> StageLists:
    """Varuna's opportunistic schedule (Athlur et al., EuroSys'22), timed with ``costs``;
    see ``varuna.py``."""
    return varuna_order(num_stages, num_micro_batches, recompute, costs)


# Name -> generator. Add an entry here to make a new policy available everywhere (its
# split-backward variant "<name>-zb" comes with it).
SCHEDULES: dict[str, ScheduleFn] = {
    "varuna": varuna,
    "1f1b": one_f_one_b,
    "gpipe": gpipe,
}


# base schedules whose order does not depend on the costs (their "-zb" variants' W placement does)
_COST_FREE = frozenset({"1f1b", "gpipe"})


def has_quick(name: str) -> bool:
    """Whether ``build_schedule(name, ..., effort="rough")`` (and maybe "quick") is cheaper
    than the full generator: Varuna's order (fewer rule variants) and every split backward
    (a rough one places W into one base order, two ways instead of three)."""
    return is_split(name) or name in CHEAPER["quick"]


def cheaper(name: str, effort: str) -> bool:
    """Whether ``build_schedule(name, ..., effort=effort)`` may give a slower order than the
    full generator ("quick": Varuna's order from fewer variants; "rough": also any split
    backward's cheaper placement)."""
    base = name[: -len(SPLIT_SUFFIX)] if is_split(name) else name
    return effort != "full" and (base in CHEAPER[effort] or (effort == "rough" and is_split(name)))


def depends_on_costs(name: str) -> bool:
    """Whether ``build_schedule(name, ...)`` orders by the costs it is given (Varuna's order,
    every split backward's W placement): such orders are made per candidate by an event
    simulation, the others once per (P, m)."""
    return name not in _COST_FREE and not is_virtual(name)


def schedule_names() -> list[str]:
    """Every schedule name :func:`build_schedule` accepts, split-backward variants included."""
    return sorted([*SCHEDULES, *(n + SPLIT_SUFFIX for n in SCHEDULES)])


def is_split(name: str) -> bool:
    """Whether ``name`` is a split-backward schedule (``<base>-zb``, or ``zbv``)."""
    if is_virtual(name):
        return VIRTUAL_SCHEDULES[name][2]
    return name.endswith(SPLIT_SUFFIX) and name[: -len(SPLIT_SUFFIX)] in SCHEDULES


def check_schedule_name(name: str) -> None:
    if name not in SCHEDULES and not is_split(name) and not is_virtual(name):
        raise ScheduleError(
            f"unknown schedule {name!r}; valid choices are: "
            f"{', '.join(schedule_names() + virtual_names())}"
        )


def default_stages_per_rank(name: str) -> int:
    """The ``stages_per_rank`` a schedule runs when none is given (1 but for virtual ones)."""
    return DEFAULT_STAGES_PER_RANK.get(name, 1)


def _virtual(name: str, num_stages: int, num_micro_batches: int, rc: tuple[bool, ...],
             stages_per_rank: int | None) -> Schedule:
    """A schedule of ``VIRTUAL_SCHEDULES``: its generator's rank lists on its placement."""
    style, generate, split = VIRTUAL_SCHEDULES[name]
    v = stages_per_rank or DEFAULT_STAGES_PER_RANK[name]
    if v < 2 or num_stages % v:
        raise ScheduleError(
            f"{name} runs several stages per rank: stages_per_rank={v} must be at least 2 and "
            f"divide the {num_stages} stages (for one stage per rank use 1f1b or varuna)"
        )
    ranks = placement_module.stage_ranks(num_stages, v, style)
    lists = generate(num_stages // v, v, num_micro_batches, rc)
    return Schedule.virtual(name, num_stages, num_micro_batches, rc, ranks, lists,
                            split_backward=split)


def recompute_per_stage(recompute: bool | Sequence[bool], num_stages: int) -> tuple[bool, ...]:
    """One bool per stage from a bool or a per-stage sequence; the last stage never recomputes."""
    if isinstance(recompute, bool):
        flags = [recompute] * num_stages
    else:
        flags = [bool(r) for r in recompute]
        if len(flags) != num_stages:
            raise ScheduleError(
                f"recompute needs one flag per stage ({num_stages}), got {len(flags)}"
            )
    return tuple(f and s < num_stages - 1 for s, f in enumerate(flags))


def _quick_varuna(num_stages: int, num_micro_batches: int, recompute: Sequence[bool],
                  costs: ScheduleCosts) -> StageLists:
    return varuna_order(num_stages, num_micro_batches, recompute, costs, QUICK_VARIANTS)


def _rough_varuna(num_stages: int, num_micro_batches: int, recompute: Sequence[bool],
                  costs: ScheduleCosts) -> StageLists:
    return varuna_order(num_stages, num_micro_batches, recompute, costs, ROUGH_VARIANTS)


# Cheaper generators for estimates (``build_schedule(effort=...)``): orders the runtime could
# run, at most as fast as the full generator's. "quick": at most a few percent slower (what
# the planner bounds the full order by); "rough": cheaper, for rows it only lists.
CHEAPER: dict[str, dict[str, ScheduleFn]] = {
    "quick": {"varuna": _quick_varuna},
    "rough": {"varuna": _rough_varuna},
}


def build_schedule(
    name: str, num_stages: int, num_micro_batches: int,
    recompute: bool | Sequence[bool] = True, costs: ScheduleCosts | None = None,
    effort: str = "full", stages_per_rank: int | None = None,
) -> Schedule:
    """Generate the schedule ``name`` for ``num_stages`` stages and ``num_micro_batches``.

    ``recompute``: one bool for every stage but the last, or one per stage. ``costs``: the
    per-stage times cost-aware orders (Varuna's, the placement of split-backward ``W``) are
    generated from; unit costs and free links when None. ``effort``: "full", or a cheaper
    generator where there is one (``CHEAPER``: the planner's estimates of its candidates).
    ``stages_per_rank``: v for a virtual schedule (``virtual.py``; default 2); 1 for the others.
    """
    check_schedule_name(name)
    if num_stages < 1:
        raise ScheduleError(f"num_stages must be >= 1, got {num_stages}")
    if num_micro_batches < 1:
        raise ScheduleError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    rc = recompute_per_stage(recompute, num_stages)
    costs = costs or ScheduleCosts.unit(num_stages)
    costs.check(num_stages)
    if is_virtual(name):
        sched = _virtual(name, num_stages, num_micro_batches, rc, stages_per_rank)
        sched.recompute = _flag(recompute, rc)
        sched.costs = costs
        return sched
    if stages_per_rank not in (None, 1):
        raise ScheduleError(
            f"{name} runs one stage per rank: stages_per_rank={stages_per_rank} needs a "
            f"schedule for several ({', '.join(virtual_names())})"
        )
    split = is_split(name)
    base = name[: -len(SPLIT_SUFFIX)] if split else name
    generate = CHEAPER[effort].get(base, SCHEDULES[base]) if effort != "full" \
        else SCHEDULES[base]
    per_stage = _cost_free(base, num_stages, num_micro_batches, rc) if base in _COST_FREE \
        else generate(num_stages, num_micro_batches, rc, costs)
    if split:
        # cost-aware base orders also from the shorter backward (B = I only), where the
        # gradients come back sooner; the split pass keeps the better
        bases = [per_stage]
        # (a rough estimate: one base, W right after B or in gaps; an order that does not
        # depend on costs is the same from any)
        if effort != "rough" and base not in _COST_FREE:
            bases.append(generate(num_stages, num_micro_batches, rc, costs.input_grad_only()))
            if bases[1] == bases[0]:
                bases.pop()
        per_stage = split_backward(bases, costs, rc, name, num_micro_batches,
                                   fit=effort != "rough")
    sched = Schedule(name, num_stages, num_micro_batches, _flag(recompute, rc), per_stage,
                     split_backward=split)
    sched.costs = costs
    return sched


def _flag(recompute: bool | Sequence[bool], rc: tuple[bool, ...]) -> bool | tuple[bool, ...]:
    """A plain bool when the flags are uniform, so old texts and callers read the same."""
    if isinstance(recompute, bool):
        return recompute
    if not any(rc):
        return False
    if all(rc[:-1]):
        return True
    return rc


# Orders that do not depend on costs, by (name, P, m, recompute flags): a planner weighing
# split backward asks for the same 1F1B or GPipe base for every candidate of one shape.
_COST_FREE_MEMO: OrderedDict[tuple[object, ...], StageLists] = OrderedDict()
_COST_FREE_SIZE = 32


def _cost_free(base: str, num_stages: int, num_micro_batches: int,
               rc: tuple[bool, ...]) -> StageLists:
    key = (base, num_stages, num_micro_batches, rc)
    if key in _COST_FREE_MEMO:
        _COST_FREE_MEMO.move_to_end(key)
    else:
        _COST_FREE_MEMO[key] = SCHEDULES[base](num_stages, num_micro_batches, rc,
                                               ScheduleCosts.unit(num_stages))
        while len(_COST_FREE_MEMO) > _COST_FREE_SIZE:
            _COST_FREE_MEMO.popitem(last=False)
    return [list(acts) for acts in _COST_FREE_MEMO[key]]  # (callers may edit their lists)


def clear_caches() -> None:
    """Forget the orders and actions the generators keep for reuse, so that the next search
    starts cold (benchmarks timing several searches in one process call this)."""
    varuna_module._MEMO.clear()
    _COST_FREE_MEMO.clear()
    varuna_module._actions.cache_clear()
    split_module._weight_actions.cache_clear()


def with_micro_batches(schedule: Schedule, num_micro_batches: int) -> Schedule:
    """``schedule`` itself when it has ``num_micro_batches``, else the same kind of schedule
    (same generator, stages, recompute and costs) for that many: a one-process pipeline
    accepts any batch the micro-batch size divides."""
    if schedule.num_micro_batches == num_micro_batches:
        return schedule
    return build_schedule(schedule.name, schedule.num_stages, num_micro_batches,
                          schedule.recompute, schedule.costs,
                          stages_per_rank=schedule.stages_per_rank if schedule.is_virtual
                          else None)
