"""State, modes and side effects against eager PyTorch (issue 9): BatchNorm buffers, in-place
statements and buffer writes, train/eval graphs, re-compiling a changed model."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import varuna_fx as vf
from support.eager import Scaled, assert_like_eager, eager_step
from tiers import product, tiered
from varuna_fx.capture.buffers import MicroBatchStateWarning

# -- BatchNorm ------------------------------------------------------------------------------


class WithBatchNorm(nn.Module):
    def __init__(self, cumulative: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.mid = nn.Linear(16, 16)
        # momentum=None averages over all batches: reads num_batches_tracked (a float() that
        # torch.export cannot trace)
        self.bn2 = nn.BatchNorm1d(16, momentum=None if cumulative else 0.3)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mid(torch.relu(self.bn(self.inp(x))))
        return self.out(torch.relu(self.bn2(h))).pow(2).mean()


@pytest.mark.parametrize("stages,recompute,tracer", tiered(
    [(1, True, "fx"), (2, True, "fx"), (2, False, "fx"), (3, True, "fx"), (2, True, "export")],
    [(2, True, "fx")], lambda c: "-".join(map(str, c))))
def test_batchnorm_statistics_follow_eager_with_one_micro_batch(stages: int, recompute: bool,
                                                               tracer: str) -> None:
    torch.manual_seed(0)
    model, x = WithBatchNorm(cumulative=tracer == "fx"), torch.randn(8, 8)
    eager = copy.deepcopy(model)
    before = {n: b.clone() for n, b in model.named_buffers()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", MicroBatchStateWarning)  # one micro-batch: no warning
        pipe = vf.compile(model, example_inputs=(x,), stages=stages, micro_batch_size=8,
                          recompute=recompute, tracer=tracer)
    for name, b in model.named_buffers():  # compile's fake runs touch nothing
        torch.testing.assert_close(b, before[name])
    for _ in range(2):  # two steps: num_batches_tracked counts 2 as in eager
        eager.zero_grad()
        pipe.zero_grad()
        eager_loss = eager(x)
        eager_loss.backward()
        loss = pipe.step(x)
    assert int(model.bn.num_batches_tracked) == 2
    assert_like_eager(pipe, model, eager, loss, eager_loss)
    pipe.eval()
    eager.eval()
    torch.testing.assert_close(pipe(x), eager(x))  # running statistics in eval


@pytest.mark.parametrize("tracer", tiered(["fx", "export"], ["fx"]))
def test_batchnorm_with_micro_batches_warns_once_at_compile(tracer: str) -> None:
    model, x = WithBatchNorm(cumulative=tracer == "fx"), torch.randn(8, 8)
    with pytest.warns(MicroBatchStateWarning, match="BatchNorm.*4 micro-batches") as caught:
        pipe = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=2,
                          tracer=tracer)
    assert len([w for w in caught if w.category is MicroBatchStateWarning]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", MicroBatchStateWarning)
        pipe.step(x)  # not again at every step
    assert int(model.bn.num_batches_tracked) == 4  # once per micro-batch, none for recompute


# -- in-place statements and buffer writes --------------------------------------------------


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        y.mul_(2.0)  # statements whose result is unused: fx used to drop them
        y.relu_()
        self.calls.add_(1)
        mask = y > 1.0
        mask.logical_not_()
        mask.masked_fill_(y < 0.1, False)
        y = y.masked_fill(mask, 0.5)
        z = self.b(y)
        z += y
        z.relu_()
        w = self.c(z)
        w.add_(1.0)
        return w.pow(2).mean()


@pytest.mark.parametrize("recompute,stages,tracer", tiered(
    product([True, False], [1, 2, 3], ["fx", "export"]),
    [(True, 3, "fx"), (False, 2, "export")], lambda c: "-".join(map(str, c))))
def test_in_place_statements_and_buffer_writes_happen_as_in_eager(tracer: str, stages: int,
                                                                 recompute: bool) -> None:
    torch.manual_seed(0)
    model, x = InPlace(), torch.randn(8, 8)
    eager, eager_loss = eager_step(model, x)
    pipe = vf.compile(model, example_inputs=(x,), stages=stages, micro_batch_size=8,
                      recompute=recompute, tracer=tracer)
    assert int(model.calls) == 0  # compile writes nothing
    loss = pipe.step(x)
    assert int(model.calls) == 1  # once per forward, not again for recompute
    assert_like_eager(pipe, model, eager, loss, eager_loss)


class WritesAView(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 1)
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.form == "narrow":
            h.narrow(-1, 0, 2).mul_(2.0)
        elif self.form == "slice":
            h[..., :2].zero_()
        elif self.form == "select":
            h.select(-1, 1).add_(1.0)
        elif self.form == "view":
            h.view(-1).mul_(0.5)
        else:  # "early": the view is taken long before the write (a cut fell between them)
            early = h[:, :2]
            g = torch.sigmoid(self.b(x))
            early.mul_(g[:, :2])
            return self.c(h).pow(2).mean()
        return self.c(h * torch.sigmoid(self.b(h))).pow(2).mean()


@pytest.mark.parametrize("form,tracer", tiered(
    product(["narrow", "slice", "select", "view", "early"], ["fx", "export"]),
    [("slice", "fx"), ("select", "export"), ("early", "fx")], lambda c: "-".join(c)))
def test_a_write_into_a_view_reaches_later_stages(form: str, tracer: str) -> None:
    # `h[..., :2].zero_()` writes h, but nothing ordered the later reads of h after it: at P > 1
    # the write was lost (every form gave the loss of no write at all); and a view sent to
    # another stage arrives as a tensor of its own, so a write into it there reached nothing
    torch.manual_seed(0)
    model, x = WritesAView(form), torch.randn(8, 8)
    eager, eager_loss = eager_step(model, x)
    # 5 stages for about 8 operations: a cut could fall between the view and the write into it
    pipe = vf.compile(model, example_inputs=(x,), stages=5, micro_batch_size=4,
                      recompute=False, tracer=tracer)
    assert_like_eager(pipe, model, eager, pipe.step(x), eager_loss)


class DeadBufferRead(nn.Module):
    """Buffers read only by expressions whose results are unused."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 3.0))
        self.register_buffer("shift", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        # computable from inputs and buffers alone (replicable); dropout(p=0) does no random
        # draw, but torch.export keeps it through dead-code elimination: the dead chain used
        # to leave `scale` read by no stage
        unused = F.dropout(x * self.scale, p=0.0, training=self.training).relu()  # noqa: F841
        unused_too = x + self.shift  # noqa: F841
        return self.b(y).pow(2).mean()


@pytest.mark.parametrize("stages,tracer", tiered(
    product([1, 2], ["fx", "export"]), [(2, "fx")], lambda c: "-".join(map(str, c))))
def test_buffer_read_only_on_a_dead_path_compiles_and_matches_eager(tracer: str,
                                                                   stages: int) -> None:
    torch.manual_seed(0)
    model, x = DeadBufferRead(), torch.randn(8, 8)
    eager, eager_loss = eager_step(model, x)
    pipe = vf.compile(model, example_inputs=(x,), stages=stages, micro_batch_size=4,
                      tracer=tracer)
    loss = pipe.step(x)
    assert_like_eager(pipe, model, eager, loss, eager_loss)


def test_buffer_writes_with_micro_batches_warn_and_count_per_micro_batch() -> None:
    model, x = InPlace(), torch.randn(8, 8)
    with pytest.warns(MicroBatchStateWarning, match="calls"):
        pipe = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=2)
    pipe.step(x)
    assert int(model.calls) == 4


class CountedScale(nn.Module):
    """Reads the buffer it writes: a recompute must see the value its forward saw."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1.0)
        return self.b(self.a(x) * self.count.clone()).mean()


def test_recompute_sees_the_buffer_its_forward_saw() -> None:
    torch.manual_seed(0)
    model, x = CountedScale(), torch.randn(8, 8)
    eager = copy.deepcopy(model)
    chunks = x.split(4)  # eager per micro-batch: the pipeline's contract under micro-batching
    eager_loss = sum(eager(c) for c in chunks) / 2
    eager_loss.backward()
    with pytest.warns(MicroBatchStateWarning):
        pipe = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=4,
                          recompute=True, schedule="gpipe")
    loss = pipe.step(x)
    assert_like_eager(pipe, model, eager, loss, eager_loss)


# -- train and eval graphs ------------------------------------------------------------------


class ModeBranches(nn.Module):
    """Reads self.training: fx and torch.export bake the branch into the graph."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)
        self.p = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.relu(self.a(x)), self.p, self.training)
        h = self.b(h)
        if self.training:
            h = h * 2.0 + 1.0
        return self.c(torch.tanh(h))


@pytest.mark.parametrize("tracer", tiered(["fx", "export"], ["export"]))
def test_eval_then_train_again_follow_eager(tracer: str) -> None:
    torch.manual_seed(0)
    model, x = ModeBranches(), torch.randn(8, 8)
    eager = copy.deepcopy(model)

    def loss_fn(out: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        return out.pow(2).mean()

    pipe = vf.compile(model, example_inputs=(x,), stages=3, micro_batch_size=4,
                      loss_fn=loss_fn, tracer=tracer)
    pipe.eval()
    eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), eager(x))
    with pytest.raises(vf.VarunaFxError, match="mode"):
        pipe.step(x)  # the plan is the training graph
    pipe.train()
    eager.train()
    torch.testing.assert_close(pipe(x), eager(x))
    eager_loss = loss_fn(eager(x), None)
    eager_loss.backward()
    assert_like_eager(pipe, model, eager, pipe.step(x), eager_loss)


@pytest.mark.parametrize("tracer", tiered(["fx", "export"], ["fx"]))
def test_eval_turns_functional_dropout_off(tracer: str) -> None:
    torch.manual_seed(0)
    model, x = ModeBranches(dropout=0.5), torch.randn(8, 8)
    pipe = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=4,
                      loss_fn=lambda out, target: out.pow(2).mean(), tracer=tracer)
    pipe.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), copy.deepcopy(model).eval()(x))


# -- re-compiling a changed model -----------------------------------------------------------


def test_recompile_after_changing_the_model_trains_the_changed_model() -> None:
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(8, 8)

    def compiled() -> vf.Pipeline:
        return vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=4)

    first = compiled()
    assert compiled().captured is first.captured  # unchanged: the cache serves
    for change in (lambda: setattr(model, "alpha", 5.0),
                   lambda: setattr(model, "act", nn.Tanh()),
                   lambda: setattr(model, "act", nn.LeakyReLU(0.5)),
                   lambda: setattr(model.act, "negative_slope", 0.1)):
        change()
        pipe = compiled()
        model.zero_grad()
        loss = pipe.step(x)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        eager_loss = model(x)
        eager_loss.backward()
        torch.testing.assert_close(loss, eager_loss.detach())
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[n], p.grad)
