"""An example batch of 1, the natural first try for a big model, compiles under both tracers
and trains like eager. Until issue 28 torch.export specialised the batch dimension to 1 (its
0/1 specialisation) and compile blamed forward's code for fixing the batch size; the capture
now sees two copies of the sample (``trace_export._at_least_two``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import varuna_fx as vf
from tiers import tiered
from varuna_fx.examples import GPT, GPTConfig, lm_loss


def _like_eager(model: nn.Module, pipe: vf.Pipeline, eager: nn.Module, *inputs: torch.Tensor,
                **kw: torch.Tensor) -> None:
    """One pipeline step on ``inputs`` equals eager's forward and backward on them."""
    eager.zero_grad(set_to_none=True)
    pipe.zero_grad()
    out = eager(*inputs, **{k: v for k, v in kw.items() if k != "target"})
    want = lm_loss(out, kw["target"]) if "target" in kw else out.loss
    want.backward()
    torch.testing.assert_close(torch.as_tensor(pipe.step(*inputs, **kw)), want.detach())
    grads = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("tracer", tiered(["export", "fx"], fast=["export"]))
def test_an_example_batch_of_one_trains_like_eager(tracer: str) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, vocab_size=64, block_size=8))
    eager = copy.deepcopy(model)
    tokens, targets = torch.randint(0, 64, (2, 1, 8))
    pipe = vf.compile(model, example_inputs=(tokens,), loss_fn=lm_loss, stages=2,
                      tracer=tracer)
    assert pipe.plan.tracer == tracer and pipe.plan.micro_batch_size == 1
    _like_eager(model, pipe, eager, tokens, target=targets)
    # the graph is not specialised to one sample: three micro-batches of one
    more, more_targets = torch.randint(0, 64, (2, 3, 8))
    _like_eager(model, pipe, eager, more, target=more_targets)


@pytest.mark.slow  # a Hugging Face model: torch.export only (fx cannot trace it)
def test_a_hugging_face_model_compiles_from_one_sample() -> None:
    from support.hf_zoo import decoder_config, tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**decoder_config()))
    eager = copy.deepcopy(model)
    ids = torch.randint(3, 64, (1, 8))
    pipe = vf.compile(model, example_inputs={"input_ids": ids, "labels": ids}, stages=2)
    assert pipe.plan.tracer == "export"
    _like_eager(model, pipe, eager, input_ids=ids, labels=ids)
