"""``grad_accum_steps`` (issue 44 item 3): the micro-batches a replica accumulates per step,
in the user's words: global batch = micro-batch x micro-batches x replicas, stated by the plan
table, checked against the other sizes given, and equal to eager on the whole batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import varuna_fx as vf
from varuna_fx.planner.options import PlanOptions
from varuna_fx.train.checks import resolve


def _loss(out: torch.Tensor, _: object) -> torch.Tensor:
    return out.pow(2).mean()


def test_grad_accum_steps_sets_the_micro_batches_and_equals_eager_on_the_whole_batch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(8, 8)
    pipe = vf.compile(model, example_inputs=(x,), stages=2, grad_accum_steps=4,
                      loss_fn=_loss)
    assert (pipe.plan.micro_batch_size, pipe.plan.num_micro_batches) == (2, 4)
    assert "global batch 8 = micro-batch 2 x 4 micro-batches x 1 replica" in str(pipe.plan)
    loss = pipe.step(x)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    eager = _loss(model(x), None)
    eager.backward()
    torch.testing.assert_close(torch.as_tensor(loss).detach(), eager.detach())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad)


@pytest.mark.parametrize("kwargs, words", [
    (dict(global_batch_size=16, micro_batch_size=4, grad_accum_steps=2, data_parallel=1),
     ["global batch of 8", "global_batch_size=16"]),
    (dict(global_batch_size=16, grad_accum_steps=3), ["does not divide", "16"]),
    (dict(grad_accum_steps=0), ["grad_accum_steps=0", "positive"]),
])
def test_sizes_that_cannot_meet_the_equation_are_refused(kwargs: dict, words: list) -> None:
    with pytest.raises(vf.VarunaFxError) as caught:
        PlanOptions(**kwargs)
    for word in words:
        assert word in str(caught.value)


def test_a_micro_batch_size_that_disagrees_with_the_example_batch_is_refused() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with pytest.raises(vf.PlanError, match=r"micro_batch_size=4 x grad_accum_steps=4"):
        vf.compile(model, example_inputs=(torch.randn(8, 8),), stages=2, micro_batch_size=4,
                   grad_accum_steps=4, loss_fn=_loss)


def test_the_train_key_frees_the_default_micro_batch_and_checks_the_equation() -> None:
    cfg, _ = resolve(["--grad-accum-steps", "8"])
    assert cfg.compile_options()["grad_accum_steps"] == 8
    assert cfg.compile_options()["micro_batch_size"] is None  # follows from the equation
    with pytest.raises(vf.VarunaFxError, match="is a global batch of 8, not global_batch_size"):
        resolve(["--grad-accum-steps", "2", "--micro-batch-size", "4", "--data-parallel", "1"])


def test_plan_for_takes_grad_accum_steps_and_searches_only_those_micro_batches() -> None:
    from varuna_fx.planner import analyze, plan_for

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    graph = analyze(model, (torch.randn(4, 8),))
    result = plan_for(graph, vf.Cluster(gpus=4, device="cpu"), global_batch_size=32,
                      grad_accum_steps=4)
    assert result.alternatives and all(a.num_micro_batches == 4 for a in result.alternatives)
    best = result.best
    assert best.micro_batch_size * 4 * best.data_parallel == 32
