"""The zoo of real code patterns (tests/support/real_zoo.py, issue 40 item 6): each model
equals eager -- loss and every gradient -- at 2 and 4 stages, micro-batches of 1 and 2, built
normally and under vf.deferred_init, with the auto tracer; docs/real_models.md is the table."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

import varuna_fx as vf
from support.real_zoo import ZOO, Entry
from tiers import tiered
from varuna_fx.capture.buffers import MicroBatchStateWarning

CONFIGS = [(2, 1, False), (2, 2, False), (4, 1, True), (4, 2, True), (2, 2, True)]
CASES = list(itertools.product(ZOO, CONFIGS))
FAST = {("nanogpt", (2, 2, True)), ("llama", (4, 1, True)), ("moe-where", (2, 2, False)),
        ("ssm-function", (2, 2, False)), ("mingpt", (4, 2, True))}


def _build(entry: Entry, deferred: bool) -> torch.nn.Module:
    if deferred:
        with vf.deferred_init(seed=5):
            return entry.build()
    torch.manual_seed(0)
    return entry.build()


def _eager(entry: Entry, deferred: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The same model built the same way (materialised with the same seed), run eagerly. Built
    twice, not deep-copied: minGPT's lambda MLP would still call the original's modules."""
    model = _build(entry, deferred)
    if deferred:
        vf.materialize(model)
    out = model(*entry.inputs)
    loss = entry.loss_fn(out, entry.target) if entry.loss_fn else out
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def check_like_eager(name: str, stages: int, micro: int, deferred: bool,
                     tracer: str = "auto") -> vf.Pipeline:
    entry = ZOO[name]
    want_loss, want = _eager(entry, deferred)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MicroBatchStateWarning)  # means of equal counts
        pipe = vf.compile(_build(entry, deferred), example_inputs=entry.inputs,
                          loss_fn=entry.loss_fn, stages=stages, micro_batch_size=micro,
                          tracer=tracer)
    target = {} if entry.target is None else {"target": entry.target}
    torch.testing.assert_close(torch.as_tensor(pipe.step(*entry.inputs, **target)), want_loss)
    names = set()
    for n, p in pipe.named_parameters():
        names.add(n)
        torch.testing.assert_close(p.grad, want[n], msg=n)
    assert names == set(want)
    return pipe


@pytest.mark.parametrize("name,config", tiered(CASES, FAST, ids=lambda c: (
    f"{c[0]}-P{c[1][0]}-mb{c[1][1]}{'-deferred' if c[1][2] else ''}")))
def test_each_zoo_model_trains_like_eager(name: str, config: tuple[int, int, bool]) -> None:
    stages, micro, deferred = config
    pipe = check_like_eager(name, stages, micro, deferred)
    assert pipe.plan.stages == stages


# every model at micro-batch 2 under export too: SDPA at dropout 0 runs batched and unmarked,
# and stage views are layout-robust where export dropped a .contiguous() (issue 40 items 1, 2)
@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in ZOO if n != "ssm-function"])
def test_each_zoo_model_trains_like_eager_under_torch_export(name: str) -> None:
    check_like_eager(name, 2, 2, True, tracer="export")


def test_export_refuses_the_straight_through_estimator_but_inlines_the_exact_scan() -> None:
    # LinearScan's backward is the exact gradient (checked, then inlined); RoundSTE's is not
    with pytest.raises(vf.CaptureError, match="Function RoundSTE.*drops its backward.*other "
                       "gradients than autograd"):
        check_like_eager("ssm-function", 2, 2, False, tracer="export")
