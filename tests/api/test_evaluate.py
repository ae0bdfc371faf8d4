"""``pipe.evaluate(batches)``: the eval loss of eager ``model.eval()`` under no_grad over the
same batches, with the modules' modes put back."""

from __future__ import annotations

import copy

import pytest
import torch

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig, lm_loss


def test_evaluate_is_eager_eval_loss_and_leaves_the_modes_as_they_were() -> None:
    torch.manual_seed(0)
    # dropout: train and eval mode differ, so the loss is eval mode's only if evaluate is
    model = GPT(GPTConfig(vocab_size=50, block_size=8, n_layer=2, n_head=2, n_embd=16,
                          dropout=0.3))
    eager = copy.deepcopy(model)
    tokens = torch.randint(0, 50, (4, 9))
    pipe = vf.compile(model, example_inputs=(tokens[:, :-1],), loss_fn=lm_loss, stages=2,
                      micro_batch_size=2)
    assert pipe.plan.stages == 2 and pipe.plan.num_micro_batches == 2
    batches = [(t[:, :-1], t[:, 1:]) for t in (torch.randint(0, 50, (4, 9)) for _ in range(3))]
    eager.eval()
    with torch.no_grad():
        expected = sum(float(lm_loss(eager(x), y)) for x, y in batches) / len(batches)
    torch.testing.assert_close(pipe.evaluate(batches), expected)
    assert model.training and all(s.module.training for s in pipe.stages)
    pipe.step(tokens[:, :-1], target=tokens[:, 1:])  # training goes on in train mode
    with pytest.raises(vf.InputError, match="no batches"):
        pipe.evaluate([])
