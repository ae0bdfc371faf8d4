"""Issue 24 item 4: dropout independent of the layout.

Random ops draw keyed by (step seed, op number, sample index in the global batch) (ir/rng.py),
so every micro-batch size, stage count, schedule and recompute setting trains on the same
masks, equal to eager on the whole batch inside ``vf.per_sample_rng``. float64 and SGD, so the
comparison is about the masks, not rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.ir.rng import RandomKey, random_begin, random_end, rng_context

BATCH = 8
STEPS = 2
LR = 0.1


def make_gpt() -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=3, n_head=2, n_embd=16,
                          dropout=0.3)).double()
    return model, torch.randint(0, 64, (STEPS, BATCH, 9))


def eager_run(model: nn.Module, tokens: torch.Tensor) -> tuple[list[torch.Tensor], dict]:
    """The reference: eager on the whole batch under the same keyed draws, SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    torch.manual_seed(123)
    for step in range(STEPS):
        x, y = tokens[step, :, :-1], tokens[step, :, 1:]
        opt.zero_grad()
        with vf.per_sample_rng(BATCH):
            loss = lm_loss(model(x), y)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.detach())
    return losses, grads


def pipe_run(pipe: vf.Pipeline, tokens: torch.Tensor) -> tuple[list[torch.Tensor], dict]:
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses, grads = [], {}
    torch.manual_seed(123)
    for step in range(STEPS):
        x, y = tokens[step, :, :-1], tokens[step, :, 1:]
        pipe.zero_grad()
        losses.append(torch.as_tensor(pipe.step(x, target=y)).detach())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
        pipe.optimizer_step(opt)
    return losses, grads


@pytest.fixture(scope="module")
def reference() -> dict:
    model, tokens = make_gpt()
    losses, grads = eager_run(model, tokens)
    return {"losses": losses, "grads": grads, "weights": dict(model.named_parameters()),
            "tokens": tokens}


def check(pipe: vf.Pipeline, reference: dict) -> None:
    losses, grads = pipe_run(pipe, reference["tokens"])
    for step, (got, want) in enumerate(zip(losses, reference["losses"])):
        torch.testing.assert_close(got, want, msg=lambda m, s=step: f"step {s} loss: {m}")
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(grads[name], reference["grads"][name], msg=name)
        torch.testing.assert_close(p.detach(), reference["weights"][name].detach(), msg=name)


LAYOUTS = [  # (stages, micro-batch size, schedule, recompute)
    (1, 8, "varuna", False), (1, 1, "gpipe", False), (2, 2, "1f1b", True),
    (3, 4, "varuna", True), (3, 1, "varuna-zb", False),
]
MORE = [(p, mb, s, r) for p in (1, 2, 3) for mb in (1, 2, 4, 8)
        for s in ("varuna", "1f1b", "gpipe", "varuna-zb") for r in (True, False)
        if (p, mb, s, r) not in LAYOUTS and (p + mb + len(s) + r) % 3 == 0]


@pytest.mark.parametrize("stages,micro,schedule,recompute", [
    *LAYOUTS, *(pytest.param(*c, marks=pytest.mark.slow) for c in MORE)])
def test_every_layout_trains_on_the_eager_masks(reference: dict, stages: int, micro: int,
                                                schedule: str, recompute: bool) -> None:
    model, tokens = make_gpt()
    pipe = vf.compile(model, example_inputs=(tokens[0, :, :-1],), loss_fn=lm_loss,
                      stages=stages, micro_batch_size=micro, schedule=schedule,
                      recompute=recompute)
    check(pipe, reference)


def test_dropout_is_active_and_seeded_per_step(reference: dict) -> None:
    """The reference is not trivially equal: another seed, or no keyed context, differs."""
    model, tokens = make_gpt()
    x, y = tokens[0, :, :-1], tokens[0, :, 1:]
    torch.manual_seed(123)
    with vf.per_sample_rng(BATCH) as seed:
        first = lm_loss(model(x), y)
    with vf.per_sample_rng(BATCH, seed=seed):  # an explicit seed: the same draws
        again = lm_loss(model(x), y)
    with vf.per_sample_rng(BATCH, seed=seed + 1):
        other = lm_loss(model(x), y)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    torch.testing.assert_close(first, reference["losses"][0])
    assert abs(float(other.detach()) - float(first.detach())) > 1e-6
    model.eval()
    assert abs(float(lm_loss(model(x), y).detach()) - float(first.detach())) > 1e-6


def test_a_replicas_rows_are_the_global_batchs_rows() -> None:
    """first_sample shifts the keys: rows 4..7 of a batch drawn alone equal those of the whole."""
    drop = nn.Dropout(0.5)
    x = torch.ones(8, 5, dtype=torch.float64)
    with vf.per_sample_rng(8, seed=3):
        whole = drop(x)
    with vf.per_sample_rng(4, seed=3, first_sample=4):
        half = drop(x[4:])
    torch.testing.assert_close(half, whole[4:], rtol=0, atol=0)
    assert not torch.equal(whole[:4], whole[4:])  # distinct samples, distinct masks


class Noisy(nn.Module):
    """Every kind of random op: nn.Dropout(0) (eager runs its kernel), shared noise without a
    batch dimension, functional dropout, a batch-first factory-like op."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.off, self.drop = nn.Dropout(0.0), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.off(self.a(x))
        h = h + 0.1 * torch.randn_like(h[:1])  # one row for the whole batch
        h = F.dropout(h, 0.3, self.training)
        return (self.drop(self.b(h)) + torch.rand_like(h)).sum(-1)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


@pytest.mark.parametrize("tracer", ["fx", pytest.param("export", marks=pytest.mark.slow)])
def test_shared_and_per_sample_draws_match_eager(tracer: str) -> None:
    torch.manual_seed(0)
    model = Noisy().double()
    x, y = torch.randn(BATCH, 6, dtype=torch.float64), torch.randn(BATCH, dtype=torch.float64)
    torch.manual_seed(5)
    with vf.per_sample_rng(BATCH):
        want = mse(model(x), y)
    want.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for stages, micro in ((1, 8), (2, 1), (3, 2)):  # micro-batch 1: shared noise stays shared
        pipe = vf.compile(model, example_inputs=(x,), loss_fn=mse, stages=stages,
                          micro_batch_size=micro, tracer=tracer)
        pipe.zero_grad()
        torch.manual_seed(5)
        torch.testing.assert_close(torch.as_tensor(pipe.step(x, target=y)), want.detach())
        for n, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, grads[n], msg=n)


class SizeLast(nn.Module):
    """Random ops issue 30 found changing with the layout: a factory whose size is not its
    first argument (``randint(low, high, size)``), and rrelu in training (its noise argument is
    written in place, its result is a new tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) + torch.randint(0, 3, (x.shape[0], 1), dtype=x.dtype)
        return self.b(F.rrelu(h, training=True)).sum(-1)


def test_factories_sized_later_and_rrelu_draw_per_sample_like_eager() -> None:
    torch.manual_seed(0)
    model = SizeLast().double()
    x, y = torch.randn(BATCH, 6, dtype=torch.float64), torch.randn(BATCH, dtype=torch.float64)
    torch.manual_seed(5)
    with vf.per_sample_rng(BATCH):
        want = mse(model(x), y)
    want.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for stages, micro in ((1, 8), (2, 2)):
        pipe = vf.compile(model, example_inputs=(x,), loss_fn=mse, stages=stages,
                          micro_batch_size=micro)
        pipe.zero_grad()
        torch.manual_seed(5)
        torch.testing.assert_close(torch.as_tensor(pipe.step(x, target=y)), want.detach())
        for n, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, grads[n], msg=n)


class Drawn(nn.Module):
    def __init__(self, draw: str) -> None:
        super().__init__()
        self.a, self.draw = nn.Linear(6, 6), draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.draw == "transposed":
            return h + torch.randn(6, h.shape[0]).T
        if self.draw == "flat":
            return h + torch.rand(h.numel()).view_as(h)
        return h[torch.randperm(h.shape[0])]


@pytest.mark.parametrize("draw,shape", [("transposed", r"\(6, b\)"), ("flat", r"\(6\*b,\)"),
                                        ("permutation", r"\(b,\)")])
def test_draws_whose_batch_is_not_dim_0_are_refused_when_the_batch_is_split(
        draw: str, shape: str) -> None:
    """Shared, such a draw takes other values at each micro-batch size; keyed per sample it
    cannot be. One micro-batch on one replica is eager's draw: allowed."""
    x = torch.randn(BATCH, 6)
    with pytest.raises(vf.InputError, match=rf"draws random numbers of shape {shape} \(b: the "
                       r"batch\) at test_dropout_layout\.py:\d+, not one independent row per "
                       r"sample.*4 micro-batches x 1 replica\).*Draw with the batch first"):
        vf.compile(Drawn(draw), example_inputs=(x,), loss_fn=mse, micro_batch_size=2)
    vf.compile(Drawn(draw), example_inputs=(x,), loss_fn=mse, micro_batch_size=BATCH)


def test_bad_batch_size_is_refused() -> None:
    with pytest.raises(vf.VarunaFxError, match="batch_size must be a positive int"):
        with vf.per_sample_rng(0):
            pass


def test_a_node_drawing_more_than_compiled_is_refused() -> None:
    """Stage code marks a node with one random op; a second one at run time is refused."""
    with rng_context(RandomKey(1, 0, 4), 0):
        random_begin(0, (True,))
        torch.rand(4, 3)
        with pytest.raises(vf.VarunaFxError, match="more random ops"):
            torch.rand(4, 3)
        random_end()


def test_outside_a_worker_the_markers_do_nothing() -> None:
    """A stage module called by hand draws from the global generator like any module."""
    torch.manual_seed(9)
    want = torch.rand(3)
    torch.manual_seed(9)
    random_begin(0, (True,))
    got = torch.rand(3)
    random_end()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
