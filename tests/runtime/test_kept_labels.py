"""Losses that average over the labels they keep, with any ``ignore_index`` (issue 42 item 10).

nanoGPT's loss is ``F.cross_entropy(..., ignore_index=-1)`` inside a forward returning
``(logits, loss)``, picked by ``loss_fn=lambda out, _: out[1]``: micro-batches keeping different
numbers of labels are weighted by their counts, as a loss the model returns is, so the pipeline
equals eager on the whole batch. Under torch.export the same loss is an aten call whose
arguments were once read at the wrong position (``ignore_index`` taken for the reduction), which
warned of "a sum, or a statistic used non-linearly" where nothing was wrong."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import varuna_fx as vf
from varuna_fx.capture.buffers import MicroBatchStateWarning
from varuna_fx.passes.sample_mixing import (
    LINEAR,
    MEAN,
    OTHER,
    Op,
    find_sample_mixing,
    kind_of_call,
)

V, B, T = 24, 4, 6


class NanoLM(nn.Module):
    """nanoGPT's shape of forward: positions, a head, (logits, loss) with ignore_index=-1."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, 8), nn.Embedding(T, 8)
        self.mix, self.head = nn.Linear(8, 8), nn.Linear(8, V, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        logits = self.head(torch.tanh(self.mix(x)))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                               ignore_index=-1)
        return logits, loss


def _batch(ignored: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    idx, targets = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    if ignored:
        targets[:2, 1:] = -1  # the first micro-batch of 2 keeps 2 labels, the second 12
    return idx, targets


def _eager(idx: torch.Tensor, targets: torch.Tensor) -> tuple[nn.Module, torch.Tensor,
                                                             dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = NanoLM()
    loss = model(idx, targets)[1]
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return model, loss.detach(), grads


def _check(pipe: vf.Pipeline, idx: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor,
           grads: dict[str, torch.Tensor]) -> None:
    pipe.zero_grad()
    got = pipe.step(idx, targets)
    torch.testing.assert_close(torch.as_tensor(got).detach(), loss)
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], msg=n)


def test_a_loss_fn_picking_the_models_own_loss_is_weighted_by_kept_labels() -> None:
    idx, targets = _batch(ignored=True)
    model, loss, grads = _eager(idx, targets)
    pipe = vf.compile(model, example_inputs=(idx, targets), loss_fn=lambda out, _: out[1],
                      stages=2, micro_batch_size=2, tracer="fx")
    _check(pipe, idx, targets, loss, grads)


def test_the_aten_cross_entropy_with_an_ignore_index_is_a_mean_not_a_false_alarm() -> None:
    """torch.export's ``aten.cross_entropy_loss(self, target, weight, reduction, ignore_index)``:
    the reduction is argument 3 (argument 4 is ignore_index, -1 here)."""
    ce = torch.ops.aten.cross_entropy_loss.default
    assert kind_of_call(ce, ("x", "t", None, 1, -1), {}) == MEAN
    assert kind_of_call(ce, ("x", "t", None, 2, -1), {}) == OTHER  # reduction="sum"
    assert kind_of_call(ce, ("x", "t"), {}) == MEAN


@pytest.mark.slow
def test_nanogpt_under_export_equals_eager_without_a_warning() -> None:
    idx, targets = _batch(ignored=False)
    model, loss, grads = _eager(idx, targets)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MicroBatchStateWarning)
        pipe = vf.compile(model, example_inputs=(idx, targets), loss_fn=lambda out, _: out[1],
                          stages=2, micro_batch_size=2, tracer="export")
        _check(pipe, idx, targets, loss, grads)


def test_a_loss_fn_averaging_over_other_ignored_labels_is_warned_about() -> None:
    """A loss_fn's own cross entropy runs outside the graph and is not weighted: targets
    holding different numbers of any negative label (an ignore_index: -100, nanoGPT's -1)
    per micro-batch are warned about, not only -100."""
    idx, targets = _batch(ignored=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(V, 8), nn.Linear(8, V))

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-1)

    pipe = vf.compile(model, example_inputs=(idx,), loss_fn=loss_fn, stages=2,
                      micro_batch_size=2)
    with pytest.warns(MicroBatchStateWarning, match=r"negative labels.*\(10, 0\)"):
        pipe.step(idx, target=targets)


def test_the_warning_names_what_reduces_over_the_batch() -> None:
    """The rules' reason says what the op is: a mean used non-linearly, or a sum."""
    def ops(kind: str, name: str) -> list[Op]:
        return [Op(name, kind, (0,), 1, (1,), 0), Op("exp", OTHER, (1,), 2, (0,), 0)]

    summed = find_sample_mixing([Op("sum_1", LINEAR, (0,), 1, (1,), 0)], [1])
    assert summed and "sums over the batch" in summed[0].reason
    mean = find_sample_mixing(ops(MEAN, "mean_1"), [2])
    assert mean and "a mean over the batch" in mean[0].reason and "non-linearly" in mean[0].reason


def test_a_loss_fn_computing_from_the_models_loss_is_averaged_as_it_is() -> None:
    """Only the very output is weighted: ``out[1] * 1.0`` is a loss of the loss_fn's own,
    averaged over micro-batches as documented (weighting it would guess at what it does)."""
    idx, targets = _batch(ignored=True)
    model, _, _ = _eager(idx, targets)
    pipe = vf.compile(model, example_inputs=(idx, targets),
                      loss_fn=lambda out, _: out[1] * 1.0, stages=2, micro_batch_size=2)
    halves = [model(idx[k:k + 2], targets[k:k + 2])[1].detach() for k in (0, 2)]
    torch.testing.assert_close(torch.as_tensor(pipe.step(idx, targets)).detach(),
                               (halves[0] + halves[1]) / 2)
