"""Virtual stages in the schedule layer: placements, generators, goldens, validator, simulator."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from varuna_fx.errors import DistributedError, ScheduleError
from varuna_fx.schedule import (
    Action,
    Kind,
    Schedule,
    build_schedule,
    execution_order,
    simulate,
    simulate_step,
    text_grid,
    validate,
    with_micro_batches,
)
from varuna_fx.schedule.lowering import lower_schedule
from varuna_fx.schedule.nccl_check import check_comms, check_schedule_comms
from varuna_fx.schedule.placement import Placement, check_world_size, stage_ranks

GOLDEN = Path(__file__).parents[1] / "golden" / "schedules"


def _golden_cases() -> list[tuple[str, int, int, int, bool]]:
    cases = [("interleaved-1f1b", p, v, m, rc) for p, v, m in
             [(4, 2, 4), (4, 2, 8), (8, 2, 8), (6, 3, 6), (4, 2, 3)] for rc in (False, True)]
    cases += [("zbv", p, 2, m, rc) for p, m in [(4, 4), (4, 2), (8, 8), (6, 7)]
              for rc in (False, True)]
    cases += [("dualpipev", p, 2, m, rc) for p, m in [(2, 3), (4, 4), (4, 2), (6, 6), (8, 8),
                                                        (6, 7)] for rc in (False, True)]
    return cases


@pytest.mark.parametrize("name,p,v,m,recompute", _golden_cases())
def test_golden(name: str, p: int, v: int, m: int, recompute: bool) -> None:
    path = GOLDEN / f"{name}_P{p}_v{v}_m{m}_r{int(recompute)}.txt"
    sched = build_schedule(name, p, m, recompute, stages_per_rank=v)
    text = str(sched)
    if os.environ.get("VARUNA_FX_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with VARUNA_FX_UPDATE_GOLDEN=1"
    assert text == path.read_text()
    assert Schedule.parse(text) == sched
    validate(Schedule.parse(text))


@pytest.mark.parametrize("name,vs", [("interleaved-1f1b", (2, 3, 4)), ("zbv", (2,)),
                                     ("dualpipev", (2,))])
def test_every_size_is_complete_and_deadlock_free(name: str, vs: tuple[int, ...]) -> None:
    for v in vs:
        for ranks in range(1, 7):
            for m in range(1, 19):
                for rc in (False, True):
                    sched = build_schedule(name, ranks * v, m, rc, stages_per_rank=v)
                    validate(sched)
                    assert sched.num_ranks == ranks and sched.stages_per_rank == v
                    # each rank runs exactly its stages, and only the last stage skips R
                    for r, acts in enumerate(sched.lists):
                        assert {a.stage for a in acts} == {s for s in range(ranks * v)
                                                           if sched.rank_of(s) == r}
                    assert all(a.kind is not Kind.R for a in sched.per_stage[-1])


def test_placements() -> None:
    assert stage_ranks(4, 2, "looped") == (0, 1, 0, 1)
    assert stage_ranks(4, 2, "v") == (0, 1, 1, 0)
    assert stage_ranks(6, 3, "looped") == (0, 1, 0, 1, 0, 1)
    assert build_schedule("zbv", 6, 6, False).stage_ranks == (0, 1, 2, 2, 1, 0)
    place = Placement(4, 3, stages_per_rank=2, style="v")
    assert place.world_size == 6 and place.ranks_per_replica == 2
    assert [place.rank(s, 1) for s in range(4)] == [2, 3, 3, 2]
    assert place.stages_of(2) == [0, 3] and place.stages_of(5) == [1, 2]
    assert place.coords(5) == (1, 2)
    assert place.pipeline_ranks(2) == [4, 5]
    assert place.replica_ranks(3) == [0, 2, 4]
    assert place.holder_ranks([0, 3]) == [0, 2, 4]  # tied embedding + head: one rank each
    assert Placement(4, 1, 2).holder_ranks([0, 3]) == [0, 1]  # looped: across ranks
    one = Placement(3, 2)
    assert [one.rank(s, 1) for s in range(3)] == [3, 4, 5] and one.coords(4) == (1, 1)
    for bad in [lambda: stage_ranks(4, 3), lambda: stage_ranks(6, 3, "v"),
                lambda: stage_ranks(4, 2, "zigzag"), lambda: Placement(5, 1, 2)]:
        with pytest.raises(ScheduleError):
            bad()
    check_world_size(4, 4, 2, stages_per_rank=2)
    with pytest.raises(DistributedError, match=r"P / v x D = 4 / 2 x 1 = 2"):
        check_world_size(4, 4, 1, stages_per_rank=2)


def test_bad_arguments() -> None:
    with pytest.raises(ScheduleError, match="stages_per_rank=3 must be at least 2 and divide"):
        build_schedule("interleaved-1f1b", 4, 4, stages_per_rank=3)
    with pytest.raises(ScheduleError, match="at least 2"):
        build_schedule("interleaved-1f1b", 4, 4, stages_per_rank=1)
    for v_shaped in ("zbv", "dualpipev"):
        with pytest.raises(ScheduleError, match="exactly 2 stages"):
            build_schedule(v_shaped, 6, 4, stages_per_rank=3)
    with pytest.raises(ScheduleError, match="one stage per rank"):
        build_schedule("1f1b", 4, 4, stages_per_rank=2)
    with pytest.raises(ScheduleError, match="unknown schedule.*zbv"):
        build_schedule("zb-v", 4, 4)


def test_text_form_and_its_errors() -> None:
    sched = build_schedule("interleaved-1f1b", 4, 4, False)
    lines = str(sched).splitlines()
    assert lines[0] == "# interleaved-1f1b P=4 m=4 recompute=False placement=0,1,0,1"
    assert lines[1].startswith("rank 0: 0F0 0F1 2F0 2F1 ")
    assert with_micro_batches(sched, 6) == build_schedule("interleaved-1f1b", 4, 6, False)
    with pytest.raises(ScheduleError, match="placement"):
        Schedule.parse("# x P=2 m=1 recompute=False placement=0,2\nrank 0: 0F0 0B0\n"
                       "rank 1: 1F0 1B0\n")
    with pytest.raises(ScheduleError, match="expected 'rank 0"):
        Schedule.parse("# x P=2 m=1 recompute=False placement=0,0\nstage 0: 0F0\n")
    # an action listed on a rank that does not run its stage
    moved = Schedule("x", 2, 1, False, _lists("0F0 0B0", "1F0 1B0"), stage_ranks=(0, 1),
                     rank_lists=_lists("0F0 1F0", "1B0 0B0"))
    with pytest.raises(ScheduleError, match="rank 0's list contains 1F0, whose stage runs on "
                       "rank 1"):
        validate(moved)
    # per-stage lists that are not the ranks' orders
    skewed = Schedule("x", 2, 2, False, _lists("0F1 0F0 0B0 0B1", "1F0 1F1 1B0 1B1"),
                      stage_ranks=(0, 0), rank_lists=_lists("0F0 0F1 1F0 1F1 1B0 1B1 0B0 0B1"))
    with pytest.raises(ScheduleError, match="Schedule.virtual"):
        validate(skewed)


def _lists(*lines: str) -> list[list[Action]]:
    return [[Action.parse(t) for t in line.split()] for line in lines]


def test_deadlock_names_ranks() -> None:
    rank0 = "0F0 0F1 3F0 3B0 0B0 3F1 3B1 0B1"
    validate(Schedule.virtual("x", 4, 2, False, (0, 1, 1, 0),
                              _lists(rank0, "1F0 2F0 2B0 1B0 1F1 2F1 2B1 1B1")))
    # rank 1 runs 1B0 before 2B0, whose gradient 1B0 needs: stuck with actions left
    sched = Schedule.virtual("x", 4, 2, False, (0, 1, 1, 0),
                             _lists(rank0, "1F0 2F0 1B0 2B0 1F1 2F1 2B1 1B1"))
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 waits at 0B0 .*rank 1 waits at 1B0"):
        execution_order(sched)


def test_interleaving_halves_the_bubble() -> None:
    """The issue's target: 4 ranks, m = 8, two stages per rank, each half of 1F1B's stage."""
    one = simulate(build_schedule("1f1b", 4, 8, False), [1.0] * 4, [2.0] * 4)
    two = simulate(build_schedule("interleaved-1f1b", 8, 8, False), [0.5] * 8, [1.0] * 8)
    ideal = 8 * 3.0
    assert one.step_time == 33.0 and two.step_time == 28.5
    assert (two.step_time - ideal) == pytest.approx(0.5 * (one.step_time - ideal))
    assert two.bubble_fraction < 0.6 * one.bubble_fraction
    zbv = simulate(build_schedule("zbv", 8, 8, False), [0.5] * 8, [1.0] * 8)
    assert zbv.step_time < two.step_time  # W fills the bubble
    for sched in (two.schedule, zbv.schedule):  # the planner's fast path agrees
        p = sched.num_stages
        timing = simulate_step(sched, [0.5] * p, [1.0] * p)
        assert timing.step_time == simulate(sched, [0.5] * p, [1.0] * p).step_time


def test_links_between_ranks_only() -> None:
    """A boundary inside one rank costs nothing; boundaries between one pair of ranks share
    its wire each way."""
    zbv = build_schedule("zbv", 4, 4, False)  # placement 0,1,1,0: boundary 1 is local
    base = simulate(zbv, [0.5] * 4, [1.0] * 4).step_time
    local_only = simulate(zbv, [0.5] * 4, [1.0] * 4, send_bytes=[0, 5.0, 0], bandwidth=1.0)
    assert local_only.step_time == base
    assert simulate(zbv, [0.5] * 4, [1.0] * 4, send_bytes=[5.0, 0, 0],
                    bandwidth=1.0).step_time > base
    looped = build_schedule("interleaved-1f1b", 4, 1, False)  # boundaries 0 and 2: rank 0 -> 1
    one = simulate(looped, [0.0] * 4, [0.0] * 4, send_bytes=[1.0, 0, 1.0], bandwidth=1.0)
    assert one.step_time == pytest.approx(4.0)  # one micro-batch: 2 forward + 2 backward hops


def test_text_grid_rows_are_ranks() -> None:
    grid = text_grid(build_schedule("zbv", 4, 2, False))
    assert "rank  0 | 0F0 0F1 .   3F0 3B0 3W0" in grid and "rank  1 | .   1F0 2F0" in grid


@pytest.mark.parametrize("name,p,m,rc", [("interleaved-1f1b", 4, 4, False),
                                         ("interleaved-1f1b", 6, 5, True),
                                         ("interleaved-1f1b", 8, 8, False),
                                         ("zbv", 4, 4, True), ("zbv", 6, 7, False),
                                         ("zbv", 8, 3, False), ("dualpipev", 4, 4, True),
                                         ("dualpipev", 6, 7, False),
                                         ("dualpipev", 8, 3, False)])
def test_nccl_order_holds_with_a_group_per_stage_direction(name: str, p: int, m: int,
                                                           rc: bool) -> None:
    """The lowered virtual schedules finish under NCCL's rules with the runtime's groups (one
    per stage direction, ``runtime/setup.build_groups``), tied first/last stages and D = 2."""
    sched = build_schedule(name, p, m, rc)
    lowered = check_schedule_comms(sched, tied=[(0, p - 1)], replicas=2, seeds=())
    assert tuple(lowered.ranks) == sched.stage_ranks
    with pytest.raises(ScheduleError, match="NCCL"):  # why the runtime does not share them
        check_comms(lower_schedule(build_schedule("zbv", 4, 4, False)), layout="rank-direction")
