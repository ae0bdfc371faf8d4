"""Virtual stages in one process: pipe.step with interleaved-1f1b, zbv and dualpipev equals
eager."""

from __future__ import annotations

import pytest
import torch

import varuna_fx as vf
from support.eager import assert_grads_equal, call_args, eager_grads
from support.registry import CASES
from tiers import product, tiered
from varuna_fx.errors import PlanError
from varuna_fx.schedule import Kind

pytestmark = pytest.mark.usefixtures("one_capture_per_model")

VIRTUAL = ["interleaved-1f1b", "zbv"]
FAST = {("gpt_tied", "zbv", True), ("gpt_tied", "interleaved-1f1b", False),
        ("unet_skips", "interleaved-1f1b", True), ("unet_skips", "zbv", False),
        ("albert_shared", "zbv", False), ("kwargs_dict", "interleaved-1f1b", True)}
# DualPipeV on the cases ZB-V's placement is about (tied first and last stages, shared weights,
# skips, keyword inputs), not the whole registry twice over
DUALPIPEV = [("gpt_tied", "dualpipev", True), ("unet_skips", "dualpipev", False),
             ("albert_shared", "dualpipev", True), ("kwargs_dict", "dualpipev", False)]


@pytest.mark.parametrize("name,schedule,recompute", tiered(
    product([n for n in CASES if CASES[n].max_stages >= 4], VIRTUAL, [True, False]) + DUALPIPEV,
    {c for c in (*FAST, *DUALPIPEV) if c[0] in CASES}, lambda c: f"{c[0]}-{c[1]}-{int(c[2])}"))
def test_virtual_step_matches_eager(name: str, schedule: str, recompute: bool) -> None:
    """P = 4 stages on 2 ranks (v = 2), m = 4: loss and every gradient as eager."""
    case = CASES[name]
    pipe = vf.compile(case.model, example_inputs=case.inputs, loss_fn=case.loss_fn,
                      stages=4, stages_per_rank=2, schedule=schedule, recompute=recompute,
                      tracer=case.tracer, micro_batch_size=case.batch_size // 4)
    plan = pipe.plan
    assert len(pipe.stages) == 4 and plan.stages_per_rank == 2
    assert plan.schedule.num_ranks == 2 and plan.num_micro_batches == 4
    style = [0, 1, 0, 1] if schedule == "interleaved-1f1b" else [0, 1, 1, 0]
    assert [plan.placement.rank(s, 0) for s in range(4)] == style
    loss, grads = eager_grads(case)
    args, kwargs = call_args(case)
    pipe.zero_grad()
    got = pipe.step(*args, target=case.target, **kwargs)
    torch.testing.assert_close(torch.as_tensor(got), loss)
    assert_grads_equal(pipe, grads)
    pipe.zero_grad()


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_dualpipev_matches_eager_at_every_depth_and_micro_batch_count(ranks: int) -> None:
    """DualPipeV on 2R stages of R ranks (R = 1: both halves of the V on one rank), m = 1 to
    8 (below and above its 2R fill), with and without recompute: the loss, every gradient
    and the forward's output as eager's."""
    case = CASES["mlp"]
    loss, grads = eager_grads(case)
    with torch.no_grad():
        output = case.model(*case.inputs)
    for b in (1, 2, 4, 8):
        for recompute in (False, True):
            pipe = vf.compile(case.model, example_inputs=case.inputs, loss_fn=case.loss_fn,
                              stages=2 * ranks, stages_per_rank=2, schedule="dualpipev",
                              recompute=recompute, micro_batch_size=b)
            sched = pipe.plan.schedule
            assert (sched.name, sched.num_ranks, sched.num_micro_batches) == (
                "dualpipev", ranks, case.batch_size // b)
            assert any(a.kind is Kind.R for a in sched.actions) == recompute
            pipe.zero_grad()
            got = pipe.step(*case.inputs, target=case.target)
            torch.testing.assert_close(torch.as_tensor(got), loss)
            assert_grads_equal(pipe, grads)
            with torch.no_grad():
                torch.testing.assert_close(pipe(*case.inputs), output)


def test_errors_name_the_fix() -> None:
    case = CASES["mlp"]
    kw = dict(example_inputs=case.inputs, loss_fn=case.loss_fn)
    with pytest.raises(PlanError, match="stages_per_rank=2"):
        vf.compile(case.model, stages=4, schedule="zbv", **kw)
    with pytest.raises(PlanError, match="interleaved-1f1b', 'zbv' or 'dualpipev'"):
        vf.compile(case.model, stages=4, stages_per_rank=2, schedule="1f1b", **kw)
    with pytest.raises(PlanError, match="multiple of stages_per_rank=2"):
        vf.compile(case.model, stages=3, stages_per_rank=2, schedule="interleaved-1f1b", **kw)
    with pytest.raises(PlanError, match="positive number"):
        vf.compile(case.model, stages=4, stages_per_rank=0, schedule="zbv", **kw)
    with pytest.raises(vf.VarunaFxError, match="exactly 2 stages"):
        vf.compile(case.model, stages=6, stages_per_rank=3, schedule="zbv", **kw)
