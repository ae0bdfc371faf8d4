"""Virtual stages in one process: pipe.step with interleaved-1f1b and zbv equals eager."""

from __future__ import annotations

import pytest
import torch

import varuna_fx as vf
from support.eager import assert_grads_equal, call_args, eager_grads
from support.registry import CASES
from tiers import product, tiered
from varuna_fx.errors import PlanError

pytestmark = pytest.mark.usefixtures("one_capture_per_model")

VIRTUAL = ["interleaved-1f1b", "zbv"]
FAST = {("gpt_tied", "zbv", True), ("gpt_tied", "interleaved-1f1b", False),
        ("unet_skips", "interleaved-1f1b", True), ("unet_skips", "zbv", False),
        ("albert_shared", "zbv", False), ("kwargs_dict", "interleaved-1f1b", True)}


@pytest.mark.parametrize("name,schedule,recompute", tiered(
    product([n for n in CASES if CASES[n].max_stages >= 4], VIRTUAL, [True, False]),
    {c for c in FAST if c[0] in CASES}, lambda c: f"{c[0]}-{c[1]}-{int(c[2])}"))
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


def test_errors_name_the_fix() -> None:
    case = CASES["mlp"]
    kw = dict(example_inputs=case.inputs, loss_fn=case.loss_fn)
    with pytest.raises(PlanError, match="stages_per_rank=2"):
        vf.compile(case.model, stages=4, schedule="zbv", **kw)
    with pytest.raises(PlanError, match="interleaved-1f1b' or 'zbv'"):
        vf.compile(case.model, stages=4, stages_per_rank=2, schedule="1f1b", **kw)
    with pytest.raises(PlanError, match="multiple of stages_per_rank=2"):
        vf.compile(case.model, stages=3, stages_per_rank=2, schedule="interleaved-1f1b", **kw)
    with pytest.raises(PlanError, match="positive number"):
        vf.compile(case.model, stages=4, stages_per_rank=0, schedule="zbv", **kw)
    with pytest.raises(vf.VarunaFxError, match="exactly 2 stages"):
        vf.compile(case.model, stages=6, stages_per_rank=3, schedule="zbv", **kw)
