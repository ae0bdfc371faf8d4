"""One typed entry per schedule (issue 27): the registry is the one place a schedule's name is
decoded, what ``schedule=`` accepts is resolved once into its entry, a schedule built from an
entry carries it, a new schedule is one entry, and one default serves every entry point."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Sequence
from pathlib import Path

import pytest

import varuna_fx as vf
from varuna_fx.errors import ScheduleError
from varuna_fx.launch.cli import build_parser
from varuna_fx.options import CompileOptions
from varuna_fx.planner import plan_for
from varuna_fx.schedule import (
    AUTO,
    DEFAULT_SCHEDULE,
    SCHEDULES,
    Action,
    Kind,
    Schedule,
    ScheduleCosts,
    ScheduleSpec,
    build_schedule,
    resolve_schedule,
    schedule_choices,
    schedule_names,
    validate,
    virtual_choices,
    virtual_names,
    weighed_schedules,
    with_micro_batches,
)

PACKAGE = Path(vf.__file__).parent


def test_every_choice_resolves_to_its_entry_and_unknown_names_are_refused() -> None:
    for name in schedule_choices():
        choice = resolve_schedule(name)
        if name == "auto":
            assert choice == AUTO
        else:
            assert isinstance(choice, ScheduleSpec) and choice is SCHEDULES[name]
            assert choice.name == name and resolve_schedule(choice) is choice
    with pytest.raises(ScheduleError, match="'zigzag' is unknown.*'zbv', 'auto'"):
        resolve_schedule("zigzag")
    with pytest.raises(ScheduleError, match="unknown schedule 'auto'"):
        build_schedule("auto", 2, 2)  # "auto" asks the planner; it is no schedule to build
    assert CompileOptions(schedule="zbv").schedule_choice is SCHEDULES["zbv"]
    assert CompileOptions().schedule_choice == AUTO


def test_the_entries_say_what_the_tables_and_the_suffix_said() -> None:
    """What SCHEDULES, VIRTUAL_SCHEDULES, DEFAULT_STAGES_PER_RANK, _COST_FREE, CHEAPER and the
    "-zb" suffix encoded before the registry, now fields of the entries."""
    by = {name: spec for name, spec in SCHEDULES.items()}
    assert {n for n, s in by.items() if s.split_backward} == {"varuna-zb", "1f1b-zb", "gpipe-zb",
                                                               "zbv", "dualpipev"}
    assert {n: (s.placement, s.stages_per_rank) for n, s in by.items() if s.virtual} == {
        "interleaved-1f1b": ("looped", 2), "zbv": ("v", 2), "dualpipev": ("v", 2)}
    assert all(s.placement == "looped" and s.stages_per_rank == 1 for s in by.values()
               if not s.virtual)
    assert {n for n, s in by.items() if not s.cost_aware} == {"1f1b", "gpipe",
                                                              "interleaved-1f1b", "zbv",
                                                              "dualpipev"}
    assert {n for n, s in by.items() if s.has_quick} == {"varuna", "varuna-zb", "1f1b-zb",
                                                          "gpipe-zb"}
    assert {n for n, s in by.items() if s.cheaper("quick")} == {"varuna", "varuna-zb"}
    assert {n for n, s in by.items() if s.cheaper("rough")} == {"varuna", "varuna-zb",
                                                                 "1f1b-zb", "gpipe-zb"}
    assert not any(s.cheaper("full") for s in by.values())
    assert {n for n, s in by.items() if s.varuna_stash} == {"varuna"}
    # "auto" weighs those of one stage per rank, ties to the first: plain before split
    assert [s.name for s in weighed_schedules("auto")] == ["varuna", "1f1b", "gpipe",
                                                           "varuna-zb", "1f1b-zb", "gpipe-zb"]
    assert weighed_schedules("zbv") == (by["zbv"],)
    # weighed in registry order (ties to the first); listed by name
    assert [s.name for s in virtual_choices()] == ["interleaved-1f1b", "zbv", "dualpipev"]
    assert virtual_names() == ["dualpipev", "interleaved-1f1b", "zbv"]
    assert schedule_choices() == [*schedule_names(), *virtual_names(), "auto"]


def test_a_built_schedule_carries_its_entry() -> None:
    for name in [*schedule_names(), *virtual_names()]:
        sched = build_schedule(name, 4, 6, True)
        assert sched.spec is SCHEDULES[name] and sched.name == name
        assert build_schedule(SCHEDULES[name], 4, 6, True) == sched
        more = with_micro_batches(sched, 8)
        assert more.spec is sched.spec and more == build_schedule(name, 4, 8, True)
    assert Schedule.parse(str(sched)).spec is None  # a text names no entry


def _last_in_first_out(num_stages: int, num_micro_batches: int, recompute: Sequence[bool],
                       costs: ScheduleCosts) -> list[list[Action]]:
    """GPipe with the backwards in reverse micro-batch order."""
    lists = []
    for s in range(num_stages):
        acts = [Action(s, Kind.F, i) for i in range(num_micro_batches)]
        for i in reversed(range(num_micro_batches)):
            acts += [Action(s, Kind.R, i)] * recompute[s] + [Action(s, Kind.B, i)]
        lists.append(acts)
    return lists


def test_a_new_schedule_is_one_entry() -> None:
    """An entry is all a schedule needs: built (split backward included), it validates and
    carries its name, without touching anything else."""
    lifo = ScheduleSpec("gpipe-lifo", order=_last_in_first_out)
    for spec in (lifo, dataclasses.replace(lifo, name="gpipe-lifo-zb", split_backward=True)):
        sched = build_schedule(spec, 3, 4, True)
        validate(sched)
        assert sched.spec is spec and sched.name == spec.name
        assert sched.split_backward == spec.split_backward
        assert sum(a.kind is Kind.W for a in sched.actions) == (12 if spec.split_backward else 0)
    assert [a.mb for a in build_schedule(lifo, 2, 3, False).per_stage[0]] == [0, 1, 2, 2, 1, 0]
    with pytest.raises(ScheduleError, match="exactly one generator"):
        ScheduleSpec("none")


def test_one_default_schedule_for_compile_plan_for_and_every_command() -> None:
    assert DEFAULT_SCHEDULE == AUTO == "auto"
    assert inspect.signature(vf.compile).parameters["schedule"].default == DEFAULT_SCHEDULE
    assert inspect.signature(plan_for).parameters["schedule"].default == DEFAULT_SCHEDULE
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    commands = [c for c in sub.choices.values()
                if any(a.dest == "schedule" for a in c._actions)]
    assert len(commands) == 2  # demo and plan (inspect compiles with compile's default)
    for command in commands:
        option = next(a for a in command._actions if a.dest == "schedule")
        assert option.default == DEFAULT_SCHEDULE and list(option.choices) == schedule_choices()


# what decoded a schedule's name outside schedule/ before the registry
# (the name predicates as plain functions, the suffix, a name compared with a literal)
_DECODING = re.compile(r"(?<![.\w])(?<!def )(is_split|is_virtual|depends_on_costs|has_quick|"
                       r"cheaper|placement_style|default_stages_per_rank|check_schedule_name)\(|"
                       r"-zb\"|(name|schedule)\s*(==|!=)\s*\"(varuna|1f1b|gpipe|zbv|interleaved)")


def test_no_code_outside_schedule_decodes_a_schedule_name() -> None:
    found = [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
             for path in sorted(PACKAGE.rglob("*.py")) if "schedule" not in path.parts
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if _DECODING.search(line)]
    assert not found, "\n".join(found)
