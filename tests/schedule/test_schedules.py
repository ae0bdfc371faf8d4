"""Schedules: text round trips, generator completeness, golden files, validation errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tiers import tiered
from varuna_fx.errors import ScheduleError, VarunaFxError
from varuna_fx.schedule import (
    Action,
    Kind,
    Schedule,
    ScheduleCosts,
    build_schedule,
    execution_order,
    is_split,
    schedule_names,
    simulate_costs,
    validate,
)
from varuna_fx.schedule.validate import dependencies

GOLDEN = Path(__file__).parents[1] / "golden" / "schedules"
NAMES = schedule_names()


def test_action_round_trip() -> None:
    act = Action(2, Kind.F, 5)
    assert str(act) == "2F5"
    assert Action.parse("2F5") == act
    assert Action.parse(" 13B107 ") == Action(13, Kind.B, 107)
    for bad in ["F5", "2X5", "2F", "2 F 5", ""]:
        with pytest.raises(ScheduleError):
            Action.parse(bad)


def test_schedule_round_trip() -> None:
    for name in NAMES:
        sched = build_schedule(name, 3, 4)
        text = str(sched)
        split = " split_backward" if is_split(name) else ""
        assert text.splitlines()[0] == f"# {name} P=3 m=4 recompute=True{split}"
        assert text.splitlines()[1].startswith("stage 0: 0F0 ")
        assert Schedule.parse(text) == sched


def test_schedule_parse_errors() -> None:
    with pytest.raises(ScheduleError, match="header"):
        Schedule.parse("stage 0: 0F0 0B0\n")
    with pytest.raises(ScheduleError, match="P=2"):
        Schedule.parse("# x P=2 m=1 recompute=False\nstage 0: 0F0 0B0\n")


def test_build_schedule_errors() -> None:
    with pytest.raises(ScheduleError, match="1f1b, 1f1b-zb, gpipe, gpipe-zb, varuna, varuna-zb"):
        build_schedule("zero-bubble", 2, 2)
    with pytest.raises(VarunaFxError, match="num_stages"):
        build_schedule("varuna", 0, 2)
    with pytest.raises(ScheduleError, match="num_micro_batches"):
        build_schedule("gpipe", 2, 0)


# fast tier: every kind with recompute but varuna-zb (its generator tries several orders per
# size); the full run checks every kind both ways
@pytest.mark.parametrize("name,recompute", tiered(
    [(n, r) for r in (True, False) for n in NAMES], lambda c: c[1] and c[0] != "varuna-zb",
    lambda c: f"{c[1]}-{c[0]}"))
def test_generators_valid_for_all_sizes(name: str, recompute: bool) -> None:
    for p in range(1, 6):
        for m in range(1, 10):
            sched = build_schedule(name, p, m, recompute)
            validate(sched)
            for s, acts in enumerate(sched.per_stage):
                n_r = sum(a.kind is Kind.R for a in acts)
                assert n_r == (m if recompute and s < p - 1 else 0)
                assert sum(a.kind is Kind.F for a in acts) == m
                assert sum(a.kind is Kind.B for a in acts) == m
                assert sum(a.kind is Kind.W for a in acts) == (m if is_split(name) else 0)


def test_execution_order_respects_stages_and_dependencies() -> None:
    for name in NAMES:
        sched = build_schedule(name, 4, 6)
        order = execution_order(sched)
        assert len(order) == len(set(order)) == len(sched.actions)
        seen: set[Action] = set()
        for act in order:
            assert all(d in seen for d in dependencies(act, sched)), act
            seen.add(act)
        for s, acts in enumerate(sched.per_stage):
            assert [a for a in order if a.stage == s] == acts
        assert execution_order(sched) == order  # deterministic


def test_1f1b_shape() -> None:
    sched = build_schedule("1f1b", 4, 8, recompute=False)
    assert " ".join(map(str, sched.per_stage[0][:6])) == "0F0 0F1 0F2 0F3 0B0 0F4"
    assert " ".join(map(str, sched.per_stage[3][:4])) == "3F0 3B0 3F1 3B1"
    # Warm-up is capped by m when there are fewer micro-batches than stages.
    short = build_schedule("1f1b", 5, 2, recompute=False)
    assert " ".join(map(str, short.per_stage[0])) == "0F0 0F1 0B0 0B1"


def test_varuna_shape() -> None:
    sched = build_schedule("varuna", 4, 8)
    last = [str(a) for a in sched.per_stage[3]]
    assert last == [f"3{k}{i}" for i in range(8) for k in "FB"]  # alternates F and B
    stage2 = " ".join(map(str, sched.per_stage[2]))
    # Forwards fill the wait for the first gradient; the recompute comes just before it.
    assert stage2.startswith("2F0 2F1 2F2 2F3 2R0 2B0")


def test_split_shape() -> None:
    sched = build_schedule("1f1b-zb", 4, 4, recompute=False)
    # ZB-H1's shape: the last stage defers its weight gradients to the end, so the input
    # gradients run back up the pipeline without waiting for them.
    assert " ".join(map(str, sched.per_stage[3])) == (
        "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3W0 3W1 3W2 3W3"
    )
    text = str(sched)
    assert text.splitlines()[0] == "# 1f1b-zb P=4 m=4 recompute=False split_backward"
    assert Schedule.parse(text) == sched


def test_per_stage_recompute() -> None:
    for name in NAMES:
        sched = build_schedule(name, 4, 5, (True, False, True, True))
        validate(sched)
        assert sched.recompute_stages == (True, False, True, False)  # never the last stage
        assert [sum(a.kind is Kind.R for a in acts) for acts in sched.per_stage] == [5, 0, 5, 0]
        assert str(sched).splitlines()[0].split()[4] == "recompute=1010"
        assert Schedule.parse(str(sched)) == sched
    with pytest.raises(ScheduleError, match="one flag per stage"):
        build_schedule("varuna", 3, 2, (True, False))


def test_split_needs_weight_gradients() -> None:
    text = "# 1f1b-zb P=1 m=1 recompute=False split_backward\nstage 0: 0F0 0B0\n"
    with pytest.raises(ScheduleError, match="missing 0W0"):
        validate(Schedule.parse(text))
    text = "# x P=1 m=1 recompute=False split_backward\nstage 0: 0F0 0W0 0B0\n"
    with pytest.raises(ScheduleError, match="0W0 comes before 0B0"):
        validate(Schedule.parse(text))


def test_costs_change_varuna_order_but_not_1f1b() -> None:
    costs = ScheduleCosts.of([1.0, 1.0, 4.0], [2.0, 2.0, 8.0], links=[3.0, 3.0])
    assert build_schedule("1f1b", 3, 6, costs=costs) == build_schedule("1f1b", 3, 6)
    aware = build_schedule("varuna", 3, 6, costs=costs)
    validate(aware)
    assert simulate_costs(aware, costs).step_time <= \
        simulate_costs(build_schedule("varuna", 3, 6), costs).step_time
    with pytest.raises(ScheduleError, match="describe 3 stages"):
        build_schedule("varuna", 4, 6, costs=costs)


def _golden_cases() -> list[tuple[str, int, int, bool]]:
    sizes = [(2, 4, True), (3, 5, True), (4, 8, True), (4, 8, False), (4, 4, False)]
    return [(name, p, m, rc) for name in NAMES for p, m, rc in sizes]


@pytest.mark.parametrize("name,p,m,recompute", _golden_cases())
def test_golden(name: str, p: int, m: int, recompute: bool) -> None:
    path = GOLDEN / f"{name}_P{p}_m{m}_r{int(recompute)}.txt"
    text = str(build_schedule(name, p, m, recompute))
    if os.environ.get("VARUNA_FX_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with VARUNA_FX_UPDATE_GOLDEN=1"
    assert text == path.read_text()
    assert Schedule.parse(path.read_text()) == build_schedule(name, p, m, recompute)


def _stages(*lines: str) -> list[list[Action]]:
    return [[Action.parse(tok) for tok in line.split()] for line in lines]


def test_deadlock_is_reported() -> None:
    # Stage 0 waits for 1B0 before sending F1; stage 1 wants F1 before running B0: a cycle.
    sched = Schedule("bad", 2, 2, False, _stages("0F0 0B0 0F1 0B1", "1F0 1F1 1B1 1B0"))
    with pytest.raises(ScheduleError) as err:
        validate(sched)
    assert str(err.value) == (
        "deadlock: stage 0 waits at 0B0 (needs 1B0), stage 1 waits at 1F1 (needs 0F1)"
    )


def test_swapped_backwards_still_valid() -> None:
    # Backwards in reverse micro-batch order on the last stage are legal, just slower.
    sched = Schedule("ok", 2, 2, False, _stages("0F0 0F1 0B0 0B1", "1F0 1F1 1B1 1B0"))
    validate(sched)


@pytest.mark.parametrize(
    "lines,recompute,match",
    [
        (("0F0", "1F0 1B0"), False, "stage 0 is missing 0B0"),
        (("0F0 0B0", "1F0 1B0 1R0"), True, "missing 0R0"),
        (("0F0 0R0 0B0", "1F0 1R0 1B0"), True, "unexpected 1R0"),
        (("0F0 0R0 0B0 0B0", "1F0 1B0"), True, "twice"),
        (("0F0 0B0 0R0", "1F0 1B0"), True, "0B0 comes before 0R0"),
        (("0F0 0B0", "1F0 0B0"), False, "belongs to stage 0"),
        (("0F0 0B0",), False, "1 stage lists but P=2"),
    ],
)
def test_incomplete_schedules_raise(lines: tuple[str, ...], recompute: bool, match: str) -> None:
    sched = Schedule("bad", 2, 1, recompute, _stages(*lines))
    with pytest.raises(ScheduleError, match=match):
        validate(sched)
