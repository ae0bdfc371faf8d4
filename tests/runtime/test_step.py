"""Issue 3: pipe.step under every schedule, stage count and recompute setting equals eager."""

from __future__ import annotations

import copy

import pytest
import torch

import varuna_fx as vf
from support.eager import assert_grads_equal, call_args, eager_grads
from support.registry import CASES
from tiers import product, slow, tiered
from varuna_fx.examples import GPT, GPTConfig, lm_loss

# the sweep compiles each unchanged registry model many times: capture it once per model
pytestmark = pytest.mark.usefixtures("one_capture_per_model")

SCHEDULES = ["varuna", "1f1b", "gpipe", "varuna-zb"]

# The fast tier's slice of the sweep: every schedule, P = 1, 2, 3, recompute and stash, every
# model defined in registry.py and one Hugging Face model (hf_gpt2, through torch.export); the
# full run covers every combination.
FAST_STEP = {
    ("mlp", 1, "gpipe", False),
    ("mlp", 2, "1f1b", True),
    ("gpt_tied", 3, "varuna", True),
    ("gpt_tied", 2, "varuna-zb", False),
    ("resnet", 2, "gpipe", True),
    ("unet_skips", 3, "1f1b", False),
    ("kwargs_dict", 2, "varuna", False),
    ("albert_shared", 3, "varuna-zb", True),
    ("hf_gpt2", 2, "varuna", True),
}


def _step_id(case: tuple) -> str:
    name, stages, schedule, recompute = case
    return f"{name}-{stages}-{schedule}-{'recompute' if recompute else 'stash'}"


@pytest.mark.parametrize("name,stages,schedule,recompute", tiered(
    product(list(CASES), [1, 2, 3, 4], SCHEDULES, [True, False]),
    {c for c in FAST_STEP if c[0] in CASES}, _step_id))  # the HF cases need transformers
def test_step_matches_eager(name: str, stages: int, schedule: str, recompute: bool) -> None:
    case = CASES[name]
    pipe = vf.compile(case.model, example_inputs=case.inputs, loss_fn=case.loss_fn,
                      stages=stages, schedule=schedule, recompute=recompute, tracer=case.tracer,
                      micro_batch_size=case.batch_size // 4)
    assert pipe.plan.num_micro_batches == 4
    loss, grads = eager_grads(case)
    args, kwargs = call_args(case)
    pipe.zero_grad()
    got = pipe.step(*args, target=case.target, **kwargs)
    torch.testing.assert_close(torch.as_tensor(got), loss)
    assert_grads_equal(pipe, grads)
    pipe.zero_grad()


@slow  # three optimizer steps per schedule; the fast tier steps every schedule once
@pytest.mark.parametrize("schedule", [*SCHEDULES, "1f1b-zb", "gpipe-zb"])
def test_three_adamw_steps_match_eager(schedule: str) -> None:
    # float64: Adam divides by sqrt(v), which turns float32 rounding in near-zero gradients
    # into full-size update differences; in double precision only real differences remain.
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=3, n_head=2, n_embd=16)).double()
    reference = copy.deepcopy(model)
    pipe = vf.compile(model, example_inputs=(torch.zeros(8, 8, dtype=torch.long),),
                      loss_fn=lm_loss, stages=3, schedule=schedule, micro_batch_size=2)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(3):
        tokens = torch.randint(0, 64, (8, 9), generator=torch.Generator().manual_seed(step))
        x, y = tokens[:, :-1], tokens[:, 1:]
        opt.zero_grad()
        loss = pipe.step(x, target=y)
        opt.step()
        ref_opt.zero_grad()
        ref_loss = lm_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(torch.as_tensor(loss), ref_loss.detach())
    for (name, p), (_, q) in zip(pipe.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, msg=name)


@slow  # four compiles; the fast tier's random models compare dropout with P=1 too
def test_recompute_replays_dropout_exactly() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=3, n_head=2, n_embd=16,
                          dropout=0.3))
    tokens = torch.randint(0, 64, (8, 9))
    x, y = tokens[:, :-1], tokens[:, 1:]
    results = {}
    for recompute in (True, False):
        pipe = vf.compile(model, example_inputs=(x,), loss_fn=lm_loss, stages=3,
                          recompute=recompute, micro_batch_size=2)
        pipe.zero_grad()
        torch.manual_seed(123)
        loss = pipe.step(x, target=y)
        results[recompute] = (loss, {n: p.grad.clone() for n, p in pipe.named_parameters()})
    (loss_r, grads_r), (loss_s, grads_s) = results[True], results[False]
    torch.testing.assert_close(loss_r, loss_s, rtol=0, atol=0)
    for name in grads_r:
        torch.testing.assert_close(grads_r[name], grads_s[name], rtol=0, atol=0, msg=name)
    # masks depend on (seed, operation, micro-batch) only, not on the partition
    one_stage = vf.compile(model, example_inputs=(x,), loss_fn=lm_loss, stages=1,
                           micro_batch_size=2)
    torch.manual_seed(123)
    torch.testing.assert_close(one_stage.step(x, target=y), loss_s)
    # and dropout really was active: another seed gives another loss
    torch.manual_seed(7)
    pipe.zero_grad()
    assert pipe.step(x, target=y) != loss_s


def test_forward_only_call_returns_the_models_output() -> None:
    case = CASES["kwargs_dict"]
    pipe = vf.compile(case.model, example_inputs=case.inputs, loss_fn=case.loss_fn, stages=3)
    with torch.no_grad():
        out = pipe(**case.inputs)
        ref = case.model(**case.inputs)
    assert set(out) == {"logits", "hidden"}
    torch.testing.assert_close(out["logits"], ref["logits"])


@slow  # another export of hf_gpt2: the fast tier checks its numerics in test_step_matches_eager
def test_hf_output_object_is_rebuilt() -> None:
    case = CASES["hf_gpt2"]
    pipe = vf.compile(case.model, example_inputs=case.inputs, stages=2)
    with torch.no_grad():
        out = pipe(**case.inputs)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    assert out.loss.dim() == 0 and out.logits.shape[:2] == (4, 12)
