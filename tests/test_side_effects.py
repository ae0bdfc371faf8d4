"""State, modes and side effects against eager PyTorch (issue 9): BatchNorm buffers, in-place
statements and buffer writes, train/eval graphs, re-compiling a changed model."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import varuna_fx as vf
from tiers import product, tiered
from varuna_fx.buffers import MicroBatchStateWarning


def assert_like_eager(pipe: vf.Pipeline, model: nn.Module, eager: nn.Module, loss: torch.Tensor,
                      eager_loss: torch.Tensor) -> None:
    torch.testing.assert_close(loss, eager_loss.detach())
    want = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, msg=lambda m, n=name: f"{n}: {m}")
    buffers = dict(eager.named_buffers())
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, buffers[name], msg=lambda m, n=name: f"{n}: {m}")


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
    eager = copy.deepcopy(model)
    eager_loss = eager(x)
    eager_loss.backward()
    pipe = vf.compile(model, example_inputs=(x,), stages=stages, micro_batch_size=8,
                      recompute=recompute, tracer=tracer)
    assert int(model.calls) == 0  # compile writes nothing
    loss = pipe.step(x)
    assert int(model.calls) == 1  # once per forward, not again for recompute
    assert_like_eager(pipe, model, eager, loss, eager_loss)


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
    eager = copy.deepcopy(model)
    eager_loss = eager(x)
    eager_loss.backward()
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


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.act: nn.Module = nn.ReLU()
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 1)
        self.alpha = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.c(self.b(self.act(self.a(x)))) * self.alpha).pow(2).mean()


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


def test_a_pipeline_refuses_to_run_a_model_edited_after_compile() -> None:
    # the stages hold the model's own objects: after `model.b = ...` the first pipeline used
    # to run the old layer while pipe.parameters() handed the optimizer the new one
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(8, 8)
    first = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=4)
    model.a.weight = nn.Parameter(torch.randn(16, 8))  # a module the stage calls: followed
    model.zero_grad()
    loss = first.step(x)
    torch.testing.assert_close(loss, model(x).detach())
    model.act.negative_slope = 0.5  # a module the graph calls: its own code follows it
    first.step(x)
    model.alpha = 5.0  # traced into the graph as a constant
    with pytest.raises(vf.VarunaFxError, match=r"Scaled\.alpha changed from 1\.0 to 5\.0"):
        first.step(x)
    model.alpha = 1.0
    first.step(x)
    hook = model.register_forward_hook(lambda module, args, out: out * 2.0)  # traced: stale
    with pytest.raises(vf.VarunaFxError, match="hook was added to or removed from Scaled"):
        first.step(x)
    hook.remove()
    model.act.register_forward_hook(lambda module, args, out: out)  # a called module: runs
    first.step(x)
    model.b = nn.Linear(16, 16)
    with pytest.raises(vf.VarunaFxError, match=r"Scaled\.b is not the submodule.*compile again"):
        first.step(x)
    with pytest.raises(vf.VarunaFxError, match="compile again"):
        first(x)
    second = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=4)
    model.zero_grad()
    torch.testing.assert_close(second.step(x), model(x).detach())
    model.double()
    with pytest.raises(vf.VarunaFxError, match=r"float64.*compile again"):
        second.step(x.double())


# -- state written by forward under fx: rebound buffers, no_grad blocks ----------------------


class RebindsBuffers(nn.Module):
    def __init__(self, twice: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 1)
        self.register_buffer("ema", torch.zeros(16))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.twice = twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.twice:  # two in-place writes: a stage may not receive the buffer between them
            self.ema.mul_(0.9).add_(h.detach().mean(0) * 0.1)
        else:  # fx proxies have no in-place operators: these rebind the attribute
            self.steps += 1
            self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)
        h = torch.relu(self.b(h)) + self.ema
        return self.c(h).pow(2).mean()


@pytest.mark.parametrize("twice,stages,tracer", tiered(
    product([False, True], [2, 3], ["fx", "export"]),
    [(False, 2, "fx"), (True, 2, "fx"), (False, 3, "export")], lambda c: "-".join(map(str, c))))
def test_buffers_rebound_or_written_twice_in_forward_follow_eager(twice: bool, stages: int,
                                                                  tracer: str) -> None:
    torch.manual_seed(0)
    model, x = RebindsBuffers(twice), torch.randn(8, 8)
    eager = copy.deepcopy(model)
    pipe = vf.compile(model, example_inputs=(x,), stages=stages, micro_batch_size=8,
                      recompute=False, tracer=tracer)
    assert type(model.ema) is torch.Tensor and type(model.steps) is torch.Tensor  # no proxies
    # one stage reads and writes each: on separate ranks a reader would keep a stale copy
    # (torch.export writes buffers back at the end of its graph: that pinned the last stage)
    for name in ("ema", "steps"):
        assert sum(name in s.spec.buffer_names for s in pipe.stages) <= 1, name
    for _ in range(2):
        eager.zero_grad()
        pipe.zero_grad()
        eager_loss = eager(x)
        eager_loss.backward()
        loss = pipe.step(x)
    assert int(model.steps) == (0 if twice else 2)
    assert_like_eager(pipe, model, eager, loss, eager_loss)


class StoresActivation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = self.a(x)
        return self.last.pow(2).mean()


def test_an_activation_stored_on_the_model_is_refused_by_fx_and_left_alone() -> None:
    model = StoresActivation()
    with pytest.raises(vf.CaptureError, match=r"self\.last.*register_buffer"):
        vf.compile(model, example_inputs=(torch.randn(4, 8),), stages=1, tracer="fx")
    assert model.last is None  # tracing used to leave an fx Proxy there


class NoGradBlock(nn.Module):
    def __init__(self, reads_activation: bool) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 1)
        self.reads_activation = reads_activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        with torch.no_grad():
            # a frozen branch (no gradient to b, nor through it to a), or a mask from the input
            t = self.b(h) if self.reads_activation else (x[:, :1] > 0).float()
        return self.c(torch.relu(self.b(h)) * t).pow(2).mean()


@pytest.mark.parametrize("reads_activation", [True, False])
def test_no_grad_block_in_forward_follows_eager(reads_activation: bool) -> None:
    # torch.fx records no grad mode: the pipeline used to back-propagate through the block
    torch.manual_seed(0)
    model, x = NoGradBlock(reads_activation), torch.randn(8, 8)
    eager = copy.deepcopy(model)
    eager_loss = eager(x)
    eager_loss.backward()
    if reads_activation:
        with pytest.raises(vf.CaptureError, match=r"torch\.no_grad\(\).*t = self\.b\(h\)"):
            vf.compile(model, example_inputs=(x,), stages=2, tracer="fx")
    pipe = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=4)
    assert pipe.captured.tracer == ("export" if reads_activation else "fx")
    assert_like_eager(pipe, model, eager, pipe.step(x), eager_loss)


class ReadsThenWrites(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.calls.float()  # read before the write, used on the last stage
        self.calls.add_(1)
        return (self.c(self.b(self.a(x))) * scale).pow(2).mean()


def test_a_buffer_read_before_its_write_is_not_recomputed_after_it() -> None:
    # `scale` depends only on a buffer, so it was copied into the last stage, which computed
    # it after stage 0 had written the buffer: scale 2 instead of 1 (loss 4x eager's)
    torch.manual_seed(0)
    model, x = ReadsThenWrites(), torch.randn(8, 8)
    eager = copy.deepcopy(model)
    eager_loss = eager(x)
    eager_loss.backward()
    pipe = vf.compile(model, example_inputs=(x,), stages=3, micro_batch_size=8)
    assert_like_eager(pipe, model, eager, pipe.step(x), eager_loss)


class NoGradStatistic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():  # torch.export: a subgraph whose result nothing reads
            self.ema.mul_(0.9).add_(h.mean(dim=0) * 0.1)
        return self.b(torch.relu(h)).pow(2).mean()


@pytest.mark.parametrize("stages", [1, 2])
def test_a_buffer_written_in_a_no_grad_block_is_written(stages: int) -> None:
    torch.manual_seed(0)
    model, x = NoGradStatistic(), torch.randn(8, 8)
    eager = copy.deepcopy(model)
    eager_loss = eager(x)
    eager_loss.backward()
    pipe = vf.compile(model, example_inputs=(x,), stages=stages, micro_batch_size=8)
    assert pipe.captured.tracer == "export"
    assert_like_eager(pipe, model, eager, pipe.step(x), eager_loss)
    assert model.ema.abs().sum() > 0


class DetachedAcross(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 1)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        stat = h.detach().mean(dim=0) * 0.1  # made on the first stage, written on the last
        h = self.c(torch.relu(self.b(torch.relu(h))))
        self.ema.mul_(0.9).add_(stat)
        return self.d(h + self.ema).pow(2).mean()


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_detached_value_crosses_stages_without_gradient(tracer: str) -> None:
    # it was received as a leaf requiring grad, so the buffer written from it required grad
    # too, holding the step's autograd graph (and deepcopy of the model failed)
    torch.manual_seed(0)
    model, x = DetachedAcross(), torch.randn(8, 8)
    eager = copy.deepcopy(model)
    pipe = vf.compile(model, example_inputs=(x,), stages=3, micro_batch_size=8, tracer=tracer)
    for _ in range(2):
        eager.zero_grad()
        pipe.zero_grad()
        eager_loss = eager(x)
        eager_loss.backward()
        loss = pipe.step(x)
    assert not model.ema.requires_grad
    assert_like_eager(pipe, model, eager, loss, eager_loss)
    copy.deepcopy(model)


def test_unfreezing_after_compile_asks_for_a_new_compile() -> None:
    # the plan decides from requires_grad at compile which values carry gradients between
    # stages: `a`, unfrozen later, silently got no gradient
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(8, 8)
    model.a.requires_grad_(False)
    pipe = vf.compile(model, example_inputs=(x,), stages=3, micro_batch_size=4)
    pipe.step(x)
    model.b.requires_grad_(False)  # freezing is followed: no gradient, as in eager
    model.zero_grad()
    pipe.step(x)
    assert model.b.weight.grad is None and model.c.weight.grad is not None
    model.requires_grad_(True)
    with pytest.raises(vf.VarunaFxError, match=r"Scaled\.a\.weight requires grad now"):
        pipe.step(x)
    pipe = vf.compile(model, example_inputs=(x,), stages=3, micro_batch_size=4)
    model.zero_grad()
    loss = pipe.step(x)
    eager = copy.deepcopy(model)
    eager.zero_grad()
    eager_loss = eager(x)
    eager_loss.backward()
    assert_like_eager(pipe, model, eager, loss, eager_loss)


WRITTEN_BUFFER_MODELS = {"rebinds": RebindsBuffers, "reads_then_writes": ReadsThenWrites,
                         "detached_across": DetachedAcross}
WRITTEN_BUFFER_JOBS = [("rebinds", "fx"), ("rebinds", "export"), ("reads_then_writes", "fx"),
                       ("detached_across", "export")]


@pytest.mark.slow
@pytest.mark.distributed
def test_written_buffers_on_three_ranks_match_eager(tmp_path: Path) -> None:
    # each rank holds its own copy of a buffer its stage reads: one stage reads and writes a
    # written buffer, else a reader's copy goes stale from the second step on
    from dist_utils import launch

    ranks = launch("written_buffers.py", 3, [str(tmp_path)], timeout=300)
    logs = "\n".join(f"--- rank {r.rank} ---\n{r.output[-2000:]}" for r in ranks)
    assert all(r.returncode == 0 for r in ranks), logs
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(3)]
    for name, tracer in WRITTEN_BUFFER_JOBS:
        torch.manual_seed(0)
        model, x = WRITTEN_BUFFER_MODELS[name](), torch.randn(8, 8)
        losses = []
        for _ in range(3):
            model.zero_grad()
            loss = model(x)
            loss.backward()
            losses.append(float(loss))
        state, grads = model.state_dict(), dict(model.named_parameters())
        for rank, result in enumerate(results):
            got = result[f"{name}-{tracer}"]
            what = f"{name} {tracer} rank {rank}"
            torch.testing.assert_close(got["losses"], losses, msg=lambda m, w=what: f"{w}: {m}")
            for k, v in got["state"].items():
                torch.testing.assert_close(v, state[k], msg=lambda m, w=what, k=k: f"{w} {k}: {m}")
            for k, g in got["grads"].items():
                torch.testing.assert_close(g, grads[k].grad,
                                           msg=lambda m, w=what, k=k: f"{w} {k}.grad: {m}")


class CountsCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # Python state: eager counts calls, a traced graph cannot
        h = torch.relu(self.a(x))
        return self.b(h * 2.0 if self.training else h).pow(2).mean()


@pytest.mark.parametrize("tracer", tiered(["fx", "export"], ["fx"]))
def test_tracing_leaves_python_state_alone(tracer: str) -> None:
    # each capture (compile, and eval mode's own graph) ran forward's Python: the counter
    # moved, which then looked like an edit of the model after compile
    model, x = CountsCalls(), torch.randn(8, 8)
    pipe = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=4, tracer=tracer)
    assert model.calls == 0
    pipe.eval()
    pipe(x)
    pipe.train()
    pipe.step(x)
    assert model.calls == 0


class WritesAnEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = F.embedding(ids, self.emb.weight)
        h.mul_(2.0)  # writes the activation, not the weight it was looked up in
        h = self.b(torch.relu(self.a(h)))
        return (h @ self.emb.weight.t()).pow(2).mean()


@pytest.mark.parametrize("tracer", tiered(["fx", "export"], ["export"]))
def test_an_in_place_write_after_a_lookup_is_not_a_buffer_write(tracer: str) -> None:
    # the write was traced back through any op to the weight: a warning named emb.weight as
    # a buffer written per micro-batch, and the weight's readers were kept on one stage
    torch.manual_seed(0)
    model, ids = WritesAnEmbedding(), torch.randint(0, 20, (8, 5))
    eager = copy.deepcopy(model)
    eager_loss = eager(ids)
    eager_loss.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MicroBatchStateWarning)
        pipe = vf.compile(model, example_inputs=(ids,), stages=3, micro_batch_size=4,
                          tracer=tracer)
    assert_like_eager(pipe, model, eager, pipe.step(ids), eager_loss)
