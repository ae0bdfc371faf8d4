"""Making a :class:`Schedule`: a registry entry (``registry.py``), P, m, recompute flags and
costs in; the per-stage (or per-rank) action lists out, validated by construction.

One stage per rank, the entry's ``order`` makes the F/R/B order (from the costs where it reads
them; the others are made once per (P, m) and kept); a split backward then places each ``W``
into it (``split.py``). Several stages per rank, the entry's ``rank_order`` makes each rank's
list on its placement (``virtual.py``, ``placement.py``). Every schedule made here carries its
entry (``Schedule.spec``), so what holds one never looks its name up again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from varuna_fx.errors import ScheduleError
from varuna_fx.schedule import placement as placement_module
from varuna_fx.schedule import split as split_module
from varuna_fx.schedule import varuna as varuna_module
from varuna_fx.schedule.actions import Schedule
from varuna_fx.schedule.generators import ScheduleFn, StageLists
from varuna_fx.schedule.registry import EFFORTS, ScheduleSpec, schedule_spec, virtual_names
from varuna_fx.schedule.schedule_costs import ScheduleCosts
from varuna_fx.schedule.split import split_backward


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


def _virtual(spec: ScheduleSpec, num_stages: int, num_micro_batches: int,
             rc: tuple[bool, ...], stages_per_rank: int | None) -> Schedule:
    """A schedule of several stages per rank: its generator's rank lists on its placement."""
    assert spec.rank_order is not None
    v = stages_per_rank or spec.stages_per_rank
    if v < 2 or num_stages % v:
        raise ScheduleError(
            f"{spec.name} runs several stages per rank: stages_per_rank={v} must be at least 2 "
            f"and divide the {num_stages} stages (for one stage per rank use 1f1b or varuna)"
        )
    ranks = placement_module.stage_ranks(num_stages, v, spec.placement)
    lists = spec.rank_order(num_stages // v, v, num_micro_batches, rc)
    return Schedule.virtual(spec.name, num_stages, num_micro_batches, rc, ranks, lists,
                            split_backward=spec.split_backward)


def build_schedule(
    name: str | ScheduleSpec, num_stages: int, num_micro_batches: int,
    recompute: bool | Sequence[bool] = True, costs: ScheduleCosts | None = None,
    effort: str = "full", stages_per_rank: int | None = None,
) -> Schedule:
    """Generate the schedule ``name`` (a registry name or entry) for ``num_stages`` stages and
    ``num_micro_batches``.

    ``recompute``: one bool for every stage but the last, or one per stage. ``costs``: the
    per-stage times cost-aware orders (Varuna's, the placement of split-backward ``W``) are
    generated from; unit costs and free links when None. ``effort``: "full", or a cheaper
    generator where there is one (``ScheduleSpec.cheaper``: the planner's estimates of its
    candidates). ``stages_per_rank``: v for a virtual schedule (default: its entry's); 1 for
    the others.
    """
    spec = schedule_spec(name)
    if num_stages < 1:
        raise ScheduleError(f"num_stages must be >= 1, got {num_stages}")
    if num_micro_batches < 1:
        raise ScheduleError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    rc = recompute_per_stage(recompute, num_stages)
    costs = costs or ScheduleCosts.unit(num_stages)
    costs.check(num_stages)
    if spec.virtual:
        sched = _virtual(spec, num_stages, num_micro_batches, rc, stages_per_rank)
    else:
        sched = Schedule(spec.name, num_stages, num_micro_batches, _flag(recompute, rc),
                         _one_per_rank(spec, num_stages, num_micro_batches, rc, costs, effort,
                                       stages_per_rank),
                         split_backward=spec.split_backward)
    sched.recompute = _flag(recompute, rc)
    sched.costs = costs
    sched.spec = spec
    return sched


def _one_per_rank(spec: ScheduleSpec, num_stages: int, num_micro_batches: int,
                  rc: tuple[bool, ...], costs: ScheduleCosts, effort: str,
                  stages_per_rank: int | None) -> StageLists:
    """The per-stage lists of a schedule of one stage per rank (``build_schedule``)."""
    assert spec.order is not None
    if stages_per_rank not in (None, 1):
        raise ScheduleError(
            f"{spec.name} runs one stage per rank: stages_per_rank={stages_per_rank} needs a "
            f"schedule for several ({', '.join(virtual_names())})"
        )
    if effort not in EFFORTS:
        raise ScheduleError(f"effort={effort!r}: use one of {EFFORTS}")
    generate = spec.cheaper_orders.get(effort, spec.order)
    per_stage = generate(num_stages, num_micro_batches, rc, costs) if spec.order_reads_costs \
        else _cost_free(spec.order, num_stages, num_micro_batches, rc)
    if not spec.split_backward:
        return per_stage
    # cost-aware base orders also from the shorter backward (B = I only), where the
    # gradients come back sooner; the split pass keeps the better
    bases = [per_stage]
    # (a rough estimate: one base, W right after B or in gaps; an order that does not
    # depend on costs is the same from any)
    if effort != "rough" and spec.order_reads_costs:
        bases.append(generate(num_stages, num_micro_batches, rc, costs.input_grad_only()))
        if bases[1] == bases[0]:
            bases.pop()
    return split_backward(bases, costs, rc, spec.name, num_micro_batches,
                          fit=effort != "rough")


def _flag(recompute: bool | Sequence[bool], rc: tuple[bool, ...]) -> bool | tuple[bool, ...]:
    """A plain bool when the flags are uniform, so old texts and callers read the same."""
    if isinstance(recompute, bool):
        return recompute
    if not any(rc):
        return False
    if all(rc[:-1]):
        return True
    return rc


# Orders that do not depend on costs, by (generator, P, m, recompute flags): a planner weighing
# split backward asks for the same 1F1B or GPipe base for every candidate of one shape.
_COST_FREE_MEMO: OrderedDict[tuple[object, ...], StageLists] = OrderedDict()
_COST_FREE_SIZE = 32


def _cost_free(order: ScheduleFn, num_stages: int, num_micro_batches: int,
               rc: tuple[bool, ...]) -> StageLists:
    key = (order, num_stages, num_micro_batches, rc)
    if key in _COST_FREE_MEMO:
        _COST_FREE_MEMO.move_to_end(key)
    else:
        _COST_FREE_MEMO[key] = order(num_stages, num_micro_batches, rc,
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
    (same entry, stages, recompute and costs) for that many: a one-process pipeline accepts
    any batch the micro-batch size divides."""
    if schedule.num_micro_batches == num_micro_batches:
        return schedule
    return build_schedule(schedule.spec or schedule.name, schedule.num_stages,
                          num_micro_batches, schedule.recompute, schedule.costs,
                          stages_per_rank=schedule.stages_per_rank if schedule.is_virtual
                          else None)
