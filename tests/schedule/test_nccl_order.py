"""Communication as schedule IR (schedule/lowering.py) and the NCCL-order checker
(schedule/nccl_check.py): every generated schedule, lowered to explicit sends and receives, is
deadlock-free under NCCL's rules with and without Varuna's run-time reorderings; crafted orders
that would hang or mis-pair on NCCL are refused, naming the stuck operations.

No GPU here, and NCCL refuses two ranks on one GPU: this checker is how the NCCL path is
verified. Regenerate the goldens with ``VARUNA_FX_UPDATE_GOLDEN=1``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from varuna_fx.errors import ScheduleError
from varuna_fx.schedule import (
    Action,
    Kind,
    Link,
    Lowered,
    OpKind,
    RankOp,
    build_schedule,
    check_comms,
    check_schedule_comms,
    execution_order,
    lower,
    lower_schedule,
    schedule_names,
    walk,
)

GOLDEN = Path(__file__).parents[1] / "golden" / "lowered"
NAMES = schedule_names()


# -- the sweep -------------------------------------------------------------------------------

SIZES = [(1, 3), (2, 1), (2, 4), (2, 8), (3, 3), (3, 5), (4, 4), (4, 8), (5, 7)]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("recompute", [True, False])
def test_every_generated_schedule_passes(name: str, recompute: bool) -> None:
    """Static order and the rule's reorderings (random interleavings, and every gradient late),
    for every generator over a sweep of P and m."""
    for p, m in SIZES:
        sched = build_schedule(name, p, m, recompute)
        check_schedule_comms(sched, seeds=(None, 0, 1))


def test_reorderings_happen_in_the_sweep() -> None:
    """The rule's runs are not the static order in disguise: forwards do jump, and the jumped
    runs still check."""
    jumped = 0
    for name in ("varuna", "varuna-zb", "1f1b-zb"):
        for p, m in [(2, 8), (3, 8), (4, 8)]:
            lowered = lower_schedule(build_schedule(name, p, m, True))
            for seed in (None, 0, 1):
                run = check_comms(lowered, reorder=True, seed=seed, late=True)
                jumped += sum(len(v) for v in run.jumped.values())
    assert jumped >= 10


def test_skips_tied_and_replicas() -> None:
    """Skip connections (one value to several later stages), a tied embedding/head summed by an
    all-reduce over stages 0 and 3 of both replicas, and each stage's data-parallel average."""
    links = [Link(0, 1), Link(1, 2), Link(2, 3), Link(0, 3, gradient=False), Link(1, 3)]
    for name in ("varuna", "1f1b", "gpipe-zb"):
        sched = build_schedule(name, 4, 6, True)
        lowered = check_schedule_comms(sched, links=links, tied=[(0, 3)], replicas=2)
        text = str(lowered)
        assert "0SEND_F2>3" in text and "3RECV_F2<0" in text
        assert "3SEND_B2>0" not in text  # 0>3 carries no gradient
        assert "ALLREDUCE(tied:0+3)" in text and "ALLREDUCE(dp:2)" in text


def _merged(name: str, ranks: tuple[int, ...], m: int) -> list[list[Action]]:
    """Each rank's actions of a 4-stage schedule in one dataflow-respecting order."""
    order = execution_order(build_schedule(name, len(ranks), m, False))
    return [[a for a in order if ranks[a.stage] == r] for r in range(max(ranks) + 1)]


@pytest.mark.parametrize("ranks", [(0, 1, 1, 0), (0, 1, 0, 1)], ids=["v-shape", "looped"])
def test_several_stages_per_rank(ranks: tuple[int, ...]) -> None:
    """A link between two stages on one rank is local (no message); every link between two
    stages gets a communicator of its own (stage-direction) and the result checks. Keyed by rank
    direction instead, the receiving rank would post a gradient and an activation from the
    same rank in another order than they are sent, which NCCL would mis-pair."""
    lowered = lower(_merged("1f1b", ranks, 4), ranks, 4, name="merged")
    text = str(lowered)
    if ranks == (0, 1, 1, 0):
        assert "1SEND_F0>2" not in text and "2SEND_B0>1" not in text  # stages 1, 2 share rank 1
    check_comms(lowered)
    for seed in (None, 0, 1):
        check_comms(lowered, reorder=True, seed=seed, late=True)
    with pytest.raises(ScheduleError, match="NCCL pairs rank 1's .* matches by order only"):
        check_comms(lowered, layout="rank-direction")


def test_direction_groups_are_what_makes_1f1b_safe() -> None:
    """The runtime posts receives ahead (lookahead): on one communicator per rank pair, stage
    0's posted receive of gradient 0 sits ahead of its send of activation 1, which stage 1 needs
    before it can send gradient 0 (runtime/setup.py build_groups). And with blocking sends and
    receives (dist.send / dist.recv) the same program hangs at its first posted receive."""
    lowered = lower_schedule(build_schedule("1f1b", 2, 4, True))
    check_comms(lowered)
    for layout in ("rank-pair", "single"):
        with pytest.raises(ScheduleError, match="NCCL-order deadlock") as err:
            check_comms(lowered, layout=layout)
        assert "rank 0 waits at 0B0 for 0RECV_B0<1" in str(err.value)
    with pytest.raises(ScheduleError, match="rank 0 waits at 0RECV_B0<1 for its 0RECV_B0<1"):
        check_comms(lowered, blocking=True)


# -- crafted orders ----------------------------------------------------------------------------

HEADER = "# crafted P=2 m=2 lookahead=0 ranks=0,1 replicas=1\n"
GOOD_0 = "rank 0: 0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1"
GOOD_1 = "rank 1: 1RECV_F0<0 1F0 1B0 1SEND_B0>0 1RECV_F1<0 1F1 1B1 1SEND_B1>0"


def _crafted(rank0: str = GOOD_0, rank1: str = GOOD_1) -> Lowered:
    return Lowered.parse(HEADER + rank0 + "\n" + rank1 + "\n")


def test_crafted_good_order_passes() -> None:
    for layout in ("stage-direction", "rank-direction"):
        check_comms(_crafted(), layout=layout)


def test_two_ranks_both_sending_first_on_blocking_communicators() -> None:
    """Rank 0 sends activation 1 before it receives gradient 0, rank 1 sends gradient 0 before
    it receives activation 1. Fine with asynchronous sends on one communicator per direction;
    with blocking sends (dist.send) both ranks sit in their sends; on one communicator for the
    pair even asynchronous sends hang, since both FIFO heads are sends."""
    with pytest.raises(ScheduleError) as err:
        check_comms(_crafted(), blocking=True)
    assert str(err.value).startswith(
        "NCCL-order deadlock in crafted (stage-direction communicators): rank 0 waits at "
        "0SEND_F1>1 for its 0SEND_F1>1 to complete; rank 1 waits at 1SEND_B0>0 for its "
        "1SEND_B0>0 to complete")
    with pytest.raises(ScheduleError) as err:
        check_comms(_crafted(), layout="rank-pair")
    text = str(err.value)
    assert text.startswith("NCCL-order deadlock in crafted (rank-pair communicators): ")
    assert "rank 0 waits at 0B0 for 0RECV_B0<1" in text
    assert "rank 1 waits at 1F1 for 1RECV_F1<0" in text
    assert "rank 0's next op on the rank 0-1 communicator is 0SEND_F1>1, rank 1's is " \
        "1SEND_B0>0" in text


def test_crossed_receive_orders_are_mis_paired() -> None:
    crossed = GOOD_1.replace("1RECV_F0<0 1F0 1B0 1SEND_B0>0 1RECV_F1<0",
                             "1RECV_F1<0 1RECV_F0<0 1F0 1B0 1SEND_B0>0")
    with pytest.raises(ScheduleError) as err:
        check_comms(_crafted(rank1=crossed))
    assert str(err.value).startswith(
        "NCCL pairs rank 1's 1RECV_F1<0 with rank 0's 0SEND_F0>1: each is number 0 on its side "
        "from rank 0 to rank 1 on one communicator, and NCCL matches by order only")


def test_crossed_blocking_receives_deadlock() -> None:
    """Each rank first receives what the other sends last: a cycle of waits."""
    rank0 = "rank 0: 0F0 0SEND_F0>1 0F1 0RECV_B1<1 0SEND_F1>1 0B1 0RECV_B0<1 0B0"
    rank1 = "rank 1: 1RECV_F1<0 1F1 1B1 1SEND_B1>0 1RECV_F0<0 1F0 1B0 1SEND_B0>0"
    with pytest.raises(ScheduleError, match="NCCL pairs"):
        check_comms(_crafted(rank0, rank1))  # async: the crossed order mis-pairs at once
    rank1 = "rank 1: 1RECV_F1<0 1F1 1B1 1SEND_B1>0 1RECV_F0<0 1F0 1B0 1SEND_B0>0"
    rank0 = "rank 0: 0F0 0F1 0RECV_B1<1 0SEND_F0>1 0SEND_F1>1 0B1 0RECV_B0<1 0B0"
    with pytest.raises(ScheduleError, match="NCCL-order deadlock") as err:
        check_comms(_crafted(rank0, rank1), blocking=True)
    assert "rank 0 waits at 0RECV_B1<1 for its 0RECV_B1<1 to complete" in str(err.value)
    assert "rank 1 waits at 1RECV_F1<0" in str(err.value)


def test_receive_posted_after_the_action_that_takes_it() -> None:
    late = GOOD_1.replace("1RECV_F0<0 1F0", "1F0 1RECV_F0<0")
    with pytest.raises(ScheduleError, match="rank 1 waits at 1F0 for 1RECV_F0<0, which it "
                       "has not posted yet"):
        check_comms(_crafted(rank1=late))


def test_send_before_its_value_exists() -> None:
    early = GOOD_0.replace("0F1 0SEND_F1>1", "0SEND_F1>1 0F1")
    with pytest.raises(ScheduleError, match="rank 0 issues 0SEND_F1>1 before computing 0F1"):
        check_comms(_crafted(rank0=early))


def test_a_send_nobody_receives() -> None:
    extra = GOOD_0 + " 0SEND_F1>1"
    with pytest.raises(ScheduleError, match="issues 0SEND_F1>1 twice"):
        check_comms(_crafted(rank0=extra))
    lonely = GOOD_1.replace(" 1RECV_F1<0", "")
    with pytest.raises(ScheduleError, match="rank 1 waits at 1F1 for 1RECV_F1<0, which it has "
                       "not posted yet"):
        check_comms(_crafted(rank1=lonely))
    unmatched = GOOD_0 + " WAIT_SENDS"
    rank1 = GOOD_1.replace(" 1RECV_F1<0 1F1", " 1F1").replace("1RECV_F0<0", "1RECV_F0<0 "
                                                               "1RECV_F1<0")
    check_comms(_crafted(unmatched, rank1))  # (the same, well formed)
    no_recv = rank1.replace(" 1RECV_F1<0", "").replace(" 1F1 1B1 1SEND_B1>0", "")
    with pytest.raises(ScheduleError, match="rank 0 waits at 0B1 for 0RECV_B1<1. Communicator "
                       "heads: rank 0's next op on the stage 0>1 communicator is 0SEND_F1>1, "
                       "rank 1's is nothing"):
        check_comms(_crafted(unmatched, no_recv))


def test_collectives_must_be_issued_by_every_member() -> None:
    one = "# c P=2 m=1 lookahead=0 ranks=0,1 replicas=1\n" \
        "rank 0: 0F0 0SEND_F0>1 0RECV_B0<1 0B0 ALLREDUCE(tied:0+1) WAIT_REDUCE\n" \
        "rank 1: 1RECV_F0<0 1F0 1B0 1SEND_B0>0 WAIT_REDUCE\n"
    with pytest.raises(ScheduleError, match="rank 0 waits at WAIT_REDUCE for ALLREDUCE"
                       r"\(tied:0\+1\).*waits for the other members"):
        check_comms(Lowered.parse(one))
    both = one.replace("1SEND_B0>0 WAIT", "1SEND_B0>0 ALLREDUCE(tied:0+1) WAIT")
    check_comms(Lowered.parse(both))
    crossed = "# c P=2 m=1 lookahead=0 ranks=0,1 replicas=1\n" \
        "rank 0: 0F0 0SEND_F0>1 0RECV_B0<1 0B0 ALLREDUCE(world) WAIT_REDUCE\n" \
        "rank 1: 1RECV_F0<0 1F0 WAIT_REDUCE ALLREDUCE(world) WAIT_REDUCE\n"
    with pytest.raises(ScheduleError, match="after the step's tail"):
        Lowered.parse(crossed.replace("1F0 WAIT_REDUCE", "WAIT_REDUCE 1F0"))


# -- the IR itself -----------------------------------------------------------------------------


def test_ops_print_and_parse() -> None:
    for text in ("2F5", "0R3", "1W0", "0SEND_F3>1", "1RECV_B2<2", "ALLREDUCE(tied:0+3)",
                 "ALLREDUCE(dp:2)", "WAIT_SENDS", "WAIT_REDUCE"):
        assert str(RankOp.parse(text)) == text
    assert RankOp.parse("0SEND_F3>1").message == RankOp.parse("1RECV_F3<0").message
    assert RankOp.parse("1SEND_B2>0").message == RankOp.parse("0RECV_B2<1").message
    for bad in ("0SEND_F3<1", "1RECV_B2>2", "2X5", "ALLREDUCE()"):
        with pytest.raises(ScheduleError):
            RankOp.parse(bad)
    with pytest.raises(ScheduleError, match="bad lowered-schedule header"):
        Lowered.parse("# nope\nrank 0: 0F0\n")
    with pytest.raises(ScheduleError, match="expected 'rank 1: <ops>'"):
        Lowered.parse(HEADER + GOOD_0 + "\nrank 5: 1F0\n")


def test_lowering_places_receives_lookahead_actions_ahead() -> None:
    sched = build_schedule("1f1b", 3, 4, False)
    lowered = lower_schedule(sched, lookahead=2)
    prog = lowered.programs[1]
    ops = [str(o) for o in prog.ops]
    # the receive of compute action k is posted just before compute action k - 2
    for k, act in enumerate(prog.compute):
        for recv in prog.waits[k]:
            before = str(RankOp.compute(prog.compute[max(0, k - 2)]))
            assert ops.index(str(recv)) < ops.index(before)
            assert ops.index(str(recv)) < ops.index(str(RankOp.compute(act)))
    # sends right after the action whose value they carry
    for k, act in enumerate(prog.compute):
        for send in prog.after[k]:
            assert ops.index(str(send)) == ops.index(str(RankOp.compute(act))) + 1 + \
                prog.after[k].index(send)
    assert [a for a in prog.compute] == sched.per_stage[1]
    with pytest.raises(ScheduleError, match="stage 1 is on rank 1"):
        lower([sched.per_stage[1], sched.per_stage[0], sched.per_stage[2]], [0, 1, 2], 4)


def test_static_walk_is_the_printed_order() -> None:
    lowered = lower_schedule(build_schedule("varuna-zb", 4, 8, True))
    for prog in lowered.programs:
        assert list(walk(prog, True, False, lambda op: True)) == prog.ops
        # with the rule but every gradient already here, nothing jumps either
        assert list(walk(prog, True, True, lambda op: True)) == prog.ops


def test_unknown_layout_and_group() -> None:
    lowered = lower_schedule(build_schedule("1f1b", 2, 2))
    with pytest.raises(ScheduleError, match="unknown communicator layout 'nope'"):
        check_comms(lowered, layout="nope")
    bad = str(lowered).replace("ALLREDUCE(world)", "ALLREDUCE(ring:0)")
    with pytest.raises(ScheduleError, match="unknown all-reduce group 'ring:0'"):
        check_comms(Lowered.parse(bad))


# -- goldens -----------------------------------------------------------------------------------

GOLDEN_CASES = [(name, p, m, rc) for name in NAMES
                for p, m, rc in [(2, 4, True), (4, 8, False)]]


@pytest.mark.parametrize("name,p,m,recompute", GOLDEN_CASES)
def test_golden(name: str, p: int, m: int, recompute: bool) -> None:
    lowered = lower_schedule(build_schedule(name, p, m, recompute))
    _check_golden(GOLDEN / f"{name}_P{p}_m{m}_r{int(recompute)}.txt", str(lowered))


def test_golden_skips_tied_replicas_and_v_shape() -> None:
    links = [Link(0, 1), Link(1, 2), Link(2, 3), Link(0, 3, gradient=False)]
    lowered = lower_schedule(build_schedule("1f1b", 4, 4, True), links=links, tied=[(0, 3)],
                             replicas=2)
    _check_golden(GOLDEN / "1f1b_P4_m4_r1_skip_tied_D2.txt", str(lowered))
    ranks = (0, 1, 1, 0)
    merged = lower(_merged("1f1b", ranks, 4), ranks, 4, name="1f1b-merged", tied=[(0, 3)])
    _check_golden(GOLDEN / "1f1b_P4_m4_r0_vshape_merged.txt", str(merged))


def _check_golden(path: Path, text: str) -> None:
    if os.environ.get("VARUNA_FX_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with VARUNA_FX_UPDATE_GOLDEN=1"
    assert text == path.read_text()
    assert str(Lowered.parse(text)) == text
    check_comms(Lowered.parse(text))


def test_kinds_cover_the_compute_letters() -> None:
    assert {k.value for k in Kind} <= {k.value for k in OpKind}
