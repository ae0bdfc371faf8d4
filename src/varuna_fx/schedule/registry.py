"""The schedule registry: one typed, frozen entry (:class:`ScheduleSpec`) per schedule.

A schedule's name is decoded here and nowhere else. What a user passes as ``schedule=`` is
resolved once (:func:`resolve_schedule`, when the options are checked) into its entry, and
everything downstream reads the entry's fields: its generator, whether it splits the backward,
runs several stages per rank and how it places them, whether its order depends on the costs,
its cheaper generators for the planner's estimates. A new schedule is one entry in
:data:`SCHEDULES` (a policy of one stage per rank gets its split-backward variant
``<name>-zb`` from :func:`_split`).

:data:`AUTO` (``"auto"``) is no entry: it asks the planner to weigh the entries
(:func:`weighed_schedules`, in registry order, so ties go to the first) and keep the fastest
that fits. It is :data:`DEFAULT_SCHEDULE`, the default of ``vf.compile``, ``plan_for`` and
every command of the CLI.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, Literal, TypeAlias

from varuna_fx.errors import ScheduleError
from varuna_fx.schedule.dualpipev import dualpipev
from varuna_fx.schedule.generators import (
    ScheduleFn,
    gpipe,
    one_f_one_b,
    quick_varuna,
    rough_varuna,
    varuna,
)
from varuna_fx.schedule.virtual import VirtualFn, interleaved_1f1b, zbv

AUTO: Final = "auto"  # schedule=: the planner picks the fastest entry that fits
DEFAULT_SCHEDULE: Final = AUTO  # of vf.compile, plan_for and the CLI
EFFORTS = ("full", "quick", "rough")  # build_schedule(effort=...): see ScheduleSpec.cheaper


@dataclass(frozen=True)
class ScheduleSpec:
    """What one schedule is, for any number of stages and micro-batches.

    Exactly one generator: ``order`` makes one list per stage (one stage per rank);
    ``rank_order`` one list per rank (several stages per rank: ``virtual``), the ranks placed by
    ``placement`` ("looped" or "v", ``placement.py``) with ``stages_per_rank`` stages each when
    none is given. ``split_backward``: each backward is cut into ``B`` (input gradients) and
    ``W`` (weight gradients); one stage per rank, ``W`` goes where stages would idle
    (``split.py``). ``order_reads_costs``: ``order`` orders by the costs it is given (Varuna's);
    the others are made once per (P, m). ``cheaper_orders``: effort ("quick", "rough") -> a
    cheaper ``order`` whose lists the runtime could run, at most as fast (the planner's
    estimates). ``varuna_stash``: Varuna's order, whose last stage holds one micro-batch and
    whose stash counts ``varuna.stash_floor`` and ``varuna.overflows`` bound before the order is
    made (the planner drops deep candidates that cannot fit early)."""

    name: str
    order: ScheduleFn | None = None
    rank_order: VirtualFn | None = None
    split_backward: bool = False
    placement: str = "looped"
    stages_per_rank: int = 1
    order_reads_costs: bool = False
    cheaper_orders: Mapping[str, ScheduleFn] = field(default_factory=dict, compare=False)
    varuna_stash: bool = False

    def __post_init__(self) -> None:
        if (self.order is None) == (self.rank_order is None):
            raise ScheduleError(f"schedule entry {self.name!r} needs exactly one generator: "
                                "order (one stage per rank) or rank_order (several)")
        object.__setattr__(self, "cheaper_orders", MappingProxyType(dict(self.cheaper_orders)))

    def __repr__(self) -> str:
        return f"ScheduleSpec({self.name!r})"  # (a Plan's or a Candidate's repr shows it)

    @property
    def virtual(self) -> bool:
        """Whether its ranks run several stages each."""
        return self.rank_order is not None

    @property
    def places_weights(self) -> bool:
        """Whether its ``W`` go where stages would idle, placed from the costs (``split.py``;
        a virtual order places its own)."""
        return self.split_backward and not self.virtual

    @property
    def cost_aware(self) -> bool:
        """Whether its order depends on the costs it is built from (Varuna's order, every
        split backward's ``W`` placement): such orders are made per planner candidate by an
        event simulation, the others once per (P, m)."""
        return self.order_reads_costs or self.places_weights

    @property
    def has_quick(self) -> bool:
        """Whether ``build_schedule(..., effort="rough")`` (and maybe "quick") is cheaper than
        the full generator: Varuna's order (fewer rule variants) and every split backward
        placed from costs (a rough one places ``W`` into one base order, two ways not three)."""
        return self.places_weights or "quick" in self.cheaper_orders

    def cheaper(self, effort: str) -> bool:
        """Whether ``build_schedule(..., effort=effort)`` may give a slower order than the
        full generator."""
        return effort in self.cheaper_orders or (effort == "rough" and self.places_weights)


SPLIT_SUFFIX = "-zb"


def _split(base: ScheduleSpec) -> ScheduleSpec:
    """``<base>-zb``: the base's order, each backward split into ``B`` and ``W`` placed where
    stages would idle (its stash may grow until each ``W``: none of Varuna's stash rules)."""
    return dataclasses.replace(base, name=base.name + SPLIT_SUFFIX, split_backward=True,
                               varuna_stash=False)


def split_base(spec: ScheduleSpec) -> ScheduleSpec:
    """The entry whose order ``spec`` splits the backward of (``1f1b`` for ``1f1b-zb``)."""
    if not spec.places_weights or not spec.name.endswith(SPLIT_SUFFIX):
        raise ScheduleError(f"{spec.name} is not a split backward placed on a base order")
    return schedule_spec(spec.name[: -len(SPLIT_SUFFIX)])


_VARUNA = ScheduleSpec("varuna", order=varuna, order_reads_costs=True, varuna_stash=True,
                       cheaper_orders={"quick": quick_varuna, "rough": rough_varuna})
_ONE_F_ONE_B = ScheduleSpec("1f1b", order=one_f_one_b)
_GPIPE = ScheduleSpec("gpipe", order=gpipe)

# Every schedule, by name. The order is the planner's preference among equally fast ones
# (schedule="auto": plain before split backward).
SCHEDULES: Mapping[str, ScheduleSpec] = MappingProxyType({s.name: s for s in (
    _VARUNA, _ONE_F_ONE_B, _GPIPE, _split(_VARUNA), _split(_ONE_F_ONE_B), _split(_GPIPE),
    ScheduleSpec("interleaved-1f1b", rank_order=interleaved_1f1b, placement="looped",
                 stages_per_rank=2),
    ScheduleSpec("zbv", rank_order=zbv, split_backward=True, placement="v", stages_per_rank=2),
    # DualPipeV: ZB-V's placement, its steady state pairing a forward on one chunk with a
    # backward on the other (``dualpipev.py``); after zbv, so zbv wins ties
    ScheduleSpec("dualpipev", rank_order=dualpipev, split_backward=True, placement="v",
                 stages_per_rank=2),
)})

# what schedule= accepts, resolved: an entry, or AUTO (the planner picks)
ScheduleChoice: TypeAlias = ScheduleSpec | Literal["auto"]


def schedule_names() -> list[str]:
    """Every schedule of one stage per rank (they run any P), split-backward ones included."""
    return sorted(name for name, s in SCHEDULES.items() if not s.virtual)


def virtual_names() -> list[str]:
    """Every schedule whose ranks run several stages each."""
    return sorted(name for name, s in SCHEDULES.items() if s.virtual)


def schedule_choices() -> list[str]:
    """What ``schedule=`` accepts: every schedule's name, and "auto"."""
    return [*schedule_names(), *virtual_names(), AUTO]


def schedule_spec(name: str | ScheduleSpec) -> ScheduleSpec:
    """The entry named ``name`` (an entry is its own); ScheduleError for an unknown name."""
    if isinstance(name, ScheduleSpec):
        return name
    found = SCHEDULES.get(name) if isinstance(name, str) else None
    if found is None:
        raise ScheduleError(f"unknown schedule {name!r}; valid choices are: "
                            f"{', '.join(schedule_names() + virtual_names())}")
    return found


def resolve_schedule(choice: str | ScheduleSpec) -> ScheduleChoice:
    """What ``schedule=`` asks for, once: its entry, or AUTO. Unknown names are refused with
    the valid choices."""
    if isinstance(choice, ScheduleSpec):
        return choice
    if choice == AUTO:
        return AUTO
    if not isinstance(choice, str) or choice not in SCHEDULES:
        raise ScheduleError(f"schedule={choice!r} is unknown; choose one of "
                            f"{schedule_choices()} (\"auto\": the planner picks the fastest "
                            "that fits)")
    return SCHEDULES[choice]


def weighed_schedules(choice: str | ScheduleSpec) -> tuple[ScheduleSpec, ...]:
    """The entries a planner for ``choice`` weighs: its own, or for "auto" every one of one
    stage per rank, in registry order (ties go to the first; the virtual ones are weighed on
    the chosen ranks afterwards: :func:`virtual_choices`)."""
    chosen = resolve_schedule(choice)
    if isinstance(chosen, ScheduleSpec):
        return (chosen,)
    return tuple(s for s in SCHEDULES.values() if not s.virtual)


def virtual_choices() -> tuple[ScheduleSpec, ...]:
    """The entries of several stages per rank, each weighed at its default stages per rank
    when the planner chooses the schedule and v (``stages_per_rank=None, schedule="auto"``)."""
    return tuple(s for s in SCHEDULES.values() if s.virtual)


# -- conveniences for a name (the callers inside the package hold entries) --------------------


def is_split(name: str) -> bool:
    """Whether ``name`` is a split-backward schedule (``<base>-zb``, ``zbv``, ``dualpipev``)."""
    found = SCHEDULES.get(name)
    return found is not None and found.split_backward


def depends_on_costs(name: str) -> bool:
    """Whether ``build_schedule(name, ...)`` orders by the costs it is given
    (:attr:`ScheduleSpec.cost_aware`)."""
    return schedule_spec(name).cost_aware
