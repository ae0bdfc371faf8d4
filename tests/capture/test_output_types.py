"""Patterns from real users' models against eager: what forward returns keeps its type."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import varuna_fx as vf

transformers = pytest.importorskip("transformers")  # the dev extra installs it


@dataclass
class _Output(transformers.utils.ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


class ReturnsModelOutput(nn.Module):
    """A HuggingFace-style model with its own code, so torch.fx traces it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> _Output:
        h = torch.tanh(self.mix(self.embed(input_ids)))
        logits = self.head(h)
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return _Output(loss=loss, logits=logits, hidden_states=None)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_model_output_dataclass_comes_back_as_itself(tracer: str) -> None:
    # under fx the pipeline returned a plain dict: `out.logits` raised AttributeError and
    # `out[0]` a KeyError, where eager's ModelOutput gives the loss
    torch.manual_seed(0)
    model, ids = ReturnsModelOutput(), torch.randint(0, 20, (4, 6))
    pipe = vf.compile(model, example_inputs={"input_ids": ids, "labels": ids}, stages=2,
                      micro_batch_size=2, tracer=tracer)
    loss = pipe.step(input_ids=ids, labels=ids)
    torch.testing.assert_close(loss, model(ids, ids).loss.detach())
    pipe.eval()
    model.eval()
    with torch.no_grad():
        out, eager = pipe(input_ids=ids, labels=ids), model(ids, ids)
    assert type(out) is _Output and list(out.keys()) == ["loss", "logits"]
    torch.testing.assert_close(out.to_tuple(), eager.to_tuple())
    torch.testing.assert_close(out[0], eager.loss)
