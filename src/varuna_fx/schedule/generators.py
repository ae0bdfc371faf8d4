"""Generators of one stage per rank: GPipe, 1F1B (PipeDream-flush) and Varuna's order.

A generator is a function ``(num_stages, num_micro_batches, recompute, costs) -> per-stage
lists``, where ``recompute`` has one bool per stage and ``costs`` are the per-stage times
(:class:`ScheduleCosts`) that cost-aware generators order by. Each is named by an entry of the
registry (``registry.py``), which also says what else the schedule is (split backward, cheaper
generators for estimates, ...); ``build.py`` makes a :class:`Schedule` from an entry. Recompute
convention shared by all generators: every stage that recomputes has one ``R`` per
micro-batch before its ``B``; the last stage keeps its activations and never recomputes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from varuna_fx.schedule.actions import Action, Kind
from varuna_fx.schedule.schedule_costs import ScheduleCosts
from varuna_fx.schedule.varuna import QUICK_VARIANTS, ROUGH_VARIANTS, varuna_order

StageLists = list[list[Action]]
ScheduleFn = Callable[[int, int, Sequence[bool], ScheduleCosts], StageLists]


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


def quick_varuna(num_stages: int, num_micro_batches: int, recompute: Sequence[bool],
                 costs: ScheduleCosts) -> StageLists:
    """Varuna's order from three of its six rule variants (at most a few percent slower)."""
    return varuna_order(num_stages, num_micro_batches, recompute, costs, QUICK_VARIANTS)


def rough_varuna(num_stages: int, num_micro_batches: int, recompute: Sequence[bool],
                 costs: ScheduleCosts) -> StageLists:
    """Varuna's order from one rule variant, for rows the planner only lists."""
    return varuna_order(num_stages, num_micro_batches, recompute, costs, ROUGH_VARIANTS)
