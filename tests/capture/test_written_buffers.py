"""Buffers written by forward and torch.no_grad() blocks against eager (fx and torch.export):
rebound buffers, writes in place, reads before a write, detached values crossing stages, and
written buffers on several ranks."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import varuna_fx as vf
from support.eager import assert_like_eager, eager_step
from support.stateful_models import (
    WRITTEN_BUFFER_JOBS,
    WRITTEN_BUFFER_MODELS,
    DetachedAcross,
    ReadsThenWrites,
    RebindsBuffers,
)
from tiers import product, tiered
from varuna_fx.capture.buffers import MicroBatchStateWarning

# -- state written by forward under fx: rebound buffers, no_grad blocks ----------------------


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


@pytest.mark.parametrize("tracer", ["fx", "export", "auto"])
def test_an_activation_stored_on_the_model_is_refused_and_left_alone(tracer: str) -> None:
    # torch.export only warned and restored the attribute: after a step it was silently unset
    model = StoresActivation()
    for _ in range(2):  # the second compile too (a warning shows once per place by default)
        with pytest.raises(vf.CaptureError, match=r"self\.last.*register_buffer"):
            vf.compile(model, example_inputs=(torch.randn(4, 8),), stages=1, tracer=tracer)
        assert model.last is None  # tracing used to leave an fx Proxy there


class WarnsInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        warnings.warn("the model's own warning", UserWarning, stacklevel=1)
        return self.a(x).pow(2).mean()


def test_other_warnings_from_torch_export_are_passed_on() -> None:
    with pytest.warns(UserWarning, match="the model's own warning"):
        vf.compile(WarnsInForward(), example_inputs=(torch.randn(4, 8),), stages=1,
                   tracer="export")


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
    eager, eager_loss = eager_step(model, x)
    if reads_activation:
        with pytest.raises(vf.CaptureError, match=r"torch\.no_grad\(\).*t = self\.b\(h\)"):
            vf.compile(model, example_inputs=(x,), stages=2, tracer="fx")
    pipe = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=4)
    assert pipe.captured.tracer == ("export" if reads_activation else "fx")
    assert_like_eager(pipe, model, eager, pipe.step(x), eager_loss)


def test_a_buffer_read_before_its_write_is_not_recomputed_after_it() -> None:
    # `scale` depends only on a buffer, so it was copied into the last stage, which computed
    # it after stage 0 had written the buffer: scale 2 instead of 1 (loss 4x eager's)
    torch.manual_seed(0)
    model, x = ReadsThenWrites(), torch.randn(8, 8)
    eager, eager_loss = eager_step(model, x)
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
    eager, eager_loss = eager_step(model, x)
    pipe = vf.compile(model, example_inputs=(x,), stages=stages, micro_batch_size=8)
    assert pipe.captured.tracer == "export"
    assert_like_eager(pipe, model, eager, pipe.step(x), eager_loss)
    assert model.ema.abs().sum() > 0


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


@pytest.mark.slow
@pytest.mark.distributed
def test_written_buffers_on_three_ranks_match_eager(tmp_path: Path) -> None:
    # each rank holds its own copy of a buffer its stage reads: one stage reads and writes a
    # written buffer, else a reader's copy goes stale from the second step on
    from support.dist import launch_ok

    launch_ok("written_buffers.py", 3, [str(tmp_path)], timeout=300)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(3)]
    for name, tracer in WRITTEN_BUFFER_JOBS:
        torch.manual_seed(0)
        model, x = WRITTEN_BUFFER_MODELS[name](), torch.randn(8, 8)
        losses = []
        for _ in range(3):
            model.zero_grad()
            loss = model(x)
            loss.backward()
            losses.append(loss.item())
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
    eager, eager_loss = eager_step(model, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MicroBatchStateWarning)
        pipe = vf.compile(model, example_inputs=(ids,), stages=3, micro_batch_size=4,
                          tracer=tracer)
    assert_like_eager(pipe, model, eager, pipe.step(ids), eager_loss)


class _CountingStack(nn.Module):
    """Reads its buffer at the first operation and writes it at the last: one stage only."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * (1 + self.count)
        for layer in self.layers:
            x = torch.relu(layer(x))
        self.count.add_(x.detach().mean())
        return x


@pytest.mark.parametrize("stages", [2, 10])
def test_too_few_cuts_because_of_a_written_buffer_names_the_buffer(stages: int) -> None:
    # the error says which buffer holds the model together and what to change
    with pytest.raises(vf.PartitionError, match=r"buffer 'count' is written in forward.*"
                                                r"close together"):
        vf.compile(_CountingStack(), example_inputs=(torch.randn(4, 8),),
                   loss_fn=lambda out, target: out.pow(2).mean(), stages=stages)


def test_the_search_names_the_buffer_that_leaves_too_few_cuts() -> None:
    # with GPUs to search over, the planner refuses first: it only said "use at most 1 stages"
    with pytest.raises(vf.PartitionError, match=r"at most 1 stages\. The buffer 'count' is "
                                                r"written in forward.*close together"):
        vf.compile(_CountingStack(), cluster=vf.Cluster(gpus=8, device="cpu"),
                   example_inputs=(torch.randn(4, 8),),
                   loss_fn=lambda out, target: out.pow(2).mean(), stages=3)


def test_a_model_without_written_buffers_does_not_mention_them() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with pytest.raises(vf.PartitionError) as raised:
        vf.compile(model, example_inputs=(torch.randn(4, 8),),
                   loss_fn=lambda out, target: out.pow(2).mean(), stages=40)
    assert "buffer" not in str(raised.value)


# -- a buffer rebound to another shape or dtype: eager swaps the tensor, a stage cannot --------


class RebindsToAnotherForm(nn.Module):
    def __init__(self, change: str) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)
        self.change = change
        self.register_buffer("stat", torch.zeros(8))
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.change == "shape":  # was copied in place: crashed on fake tensors
            self.stat = h.detach().mean(0)[:4]
        elif self.change == "broadcast":  # was broadcast into all 8 entries
            self.stat = h.detach().mean()
        elif self.change == "dtype":  # was cast back to float32
            self.count = self.count.double() + 1
        else:  # "untraced": fx never sees torch.zeros(4) being made
            self.stat = torch.zeros(4)
        return self.b(h).pow(2).mean()


@pytest.mark.parametrize("change,tracer", tiered(
    product(["shape", "broadcast", "dtype", "untraced"], ["fx", "export"]),
    [("dtype", "fx"), ("broadcast", "export"), ("untraced", "fx")],
    lambda c: "-".join(c)))
def test_a_buffer_rebound_to_another_shape_or_dtype_is_refused(change: str, tracer: str) -> None:
    model, x = RebindsToAnotherForm(change), torch.randn(8, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    name = "count" if change == "dtype" else "stat"
    match = (r"rebinds buffer self\.stat to a tensor that does not depend on the inputs.*"
             r"in place" if (change, tracer) == ("untraced", "fx") else
             rf"rebinds buffer self\.{name} \(a float32 tensor of shape .*\) to a "
             r"float(32|64) tensor of shape .*keeps a buffer's shape and dtype")
    with pytest.raises(vf.CaptureError, match=match):
        vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=8, tracer=tracer)
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():  # compile left the model as it was
        assert after[key].shape == value.shape and after[key].dtype == value.dtype, key


class RebindsInASubmodule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.norm = _RunningMean()
        self.c = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.norm(torch.relu(self.a(x)))).pow(2).mean()


class _RunningMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.mean = 0.5 * self.mean + 0.5 * h.detach().mean(0)
        return h - self.mean


@pytest.mark.parametrize("tracer", ["fx", "auto"])
def test_a_submodule_buffer_rebound_in_forward_follows_eager(tracer: str) -> None:
    torch.manual_seed(0)
    model, x = RebindsInASubmodule(), torch.randn(8, 8)
    eager = copy.deepcopy(model)
    pipe = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=8, tracer=tracer)
    for _ in range(2):
        eager.zero_grad()
        pipe.zero_grad()
        eager_loss = eager(x)
        eager_loss.backward()
        loss = pipe.step(x)
    assert_like_eager(pipe, model, eager, loss, eager_loss)


def test_torch_export_dropping_a_submodule_buffer_rebinding_is_refused() -> None:
    # torch.export (2.13) writes back only the root module's rebound buffers: norm.mean
    # silently stayed zero
    with pytest.raises(vf.CaptureError, match=r"RebindsInASubmodule\.norm\.mean is a buffer "
                                              r"that forward rebinds.*copy_"):
        vf.compile(RebindsInASubmodule(), example_inputs=(torch.randn(8, 8),), stages=2,
                   tracer="export")


# -- a parameter written in place in forward --------------------------------------------------


class ClipsAWeight(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 1)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "no_grad":  # WGAN-style clipping
            with torch.no_grad():
                self.b.weight.clamp_(-0.1, 0.1)
        else:
            self.b.weight.data.mul_(0.9)
        return self.c(torch.relu(self.b(torch.relu(self.a(x))))).pow(2).mean()


@pytest.mark.parametrize("how,tracer", [("data", "fx"), ("no_grad", "export")])
def test_a_parameter_written_in_forward_is_refused(how: str, tracer: str) -> None:
    # recompute wrote w.data.mul_(0.9) twice per step; under torch.export the linear read the
    # clamped weight from the no_grad block, and b.weight got no gradient at P = 3
    with pytest.raises(vf.CaptureError, match=r"ClipsAWeight\.forward writes the parameter "
                                              r"b\.weight in place.*outside forward"):
        vf.compile(ClipsAWeight(how), example_inputs=(torch.randn(4, 8),), stages=3,
                   tracer=tracer)


def test_an_embedding_with_max_norm_follows_eager() -> None:
    # torch.export shows its renorm as an in-place write into the weight: same values on replay
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8, max_norm=1.0), nn.Flatten(), nn.Linear(40, 1))
    ids = torch.randint(0, 20, (4, 5))
    eager = copy.deepcopy(model)
    pipe = vf.compile(model, example_inputs=(ids,), loss_fn=lambda out, t: out.pow(2).mean(),
                      stages=3, micro_batch_size=2, recompute=True, tracer="export")
    loss = pipe.step(ids, target=torch.zeros(4))
    eager_loss = eager(ids).pow(2).mean()
    eager_loss.backward()
    assert_like_eager(pipe, model, eager, loss, eager_loss)
