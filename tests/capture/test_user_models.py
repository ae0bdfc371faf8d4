"""Models a new user would try (issue 9): torchvision-style in-place ResNet blocks, HF
encoder-decoders given only labels, outputs holding None, the loss_fn contract."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import varuna_fx as vf
from tiers import slow, tiered


def eager_reference(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def assert_grads(model: nn.Module, want: dict[str, torch.Tensor], **tol: float) -> None:
    for name, p in model.named_parameters():
        if name in want:
            torch.testing.assert_close(p.grad, want[name], msg=lambda m, n=name: f"{n}: {m}",
                                       **tol)
        else:
            assert p.grad is None or not p.grad.any(), name


# -- torchvision-style ResNet: ReLU(inplace=True) and `out += identity` ---------------------


class BasicBlock(nn.Module):
    """torchvision.models.resnet.BasicBlock, GroupNorm for BatchNorm (statistics per
    micro-batch are BatchNorm's own limit, tested elsewhere)."""

    def __init__(self, planes: int, stride: int = 1) -> None:
        super().__init__()
        inplanes = planes if stride == 1 else planes // 2
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.GroupNorm(2, planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.GroupNorm(2, planes)
        self.downsample = None if stride == 1 else nn.Conv2d(inplanes, planes, 1, stride,
                                                             bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class TinyResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.relu = nn.ReLU(inplace=True)
        self.layers = nn.Sequential(BasicBlock(8), BasicBlock(8), BasicBlock(16, 2),
                                    BasicBlock(16))
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.relu(self.conv1(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


@slow  # three schedules per P; the fast tier's registry and random models cover in-place
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_resnet_in_place_blocks_match_eager(stages: int) -> None:
    torch.manual_seed(0)
    model, x, y = TinyResNet(), torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))
    want_loss = F.cross_entropy(model(x), y)
    want = eager_reference(model, want_loss)
    for schedule in ("varuna", "1f1b", "gpipe"):
        for recompute in (True, False):
            pipe = vf.compile(model, example_inputs=(x,), loss_fn=F.cross_entropy,
                              stages=stages, micro_batch_size=2, schedule=schedule,
                              recompute=recompute)
            loss = pipe.step(x, target=y)
            torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-5, atol=1e-6)
            assert_grads(model, want, rtol=1e-4, atol=1e-6)
            pipe.zero_grad()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))


# -- HuggingFace encoder-decoders given only labels -----------------------------------------


def _t5() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import transformers as tf

    cfg = tf.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                      num_decoder_layers=1, num_heads=2, dropout_rate=0.0,
                      decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    return tf.T5ForConditionalGeneration(cfg), {
        "input_ids": torch.randint(1, 64, (4, 6)), "labels": torch.randint(1, 64, (4, 5))}


def _whisper() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import transformers as tf

    cfg = tf.WhisperConfig(vocab_size=64, num_mel_bins=8, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=2, decoder_attention_heads=2, d_model=16,
                           encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=8,
                           max_target_positions=16, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2, decoder_start_token_id=1, use_cache=False,
                           dropout=0.0)
    return tf.WhisperForConditionalGeneration(cfg), {
        "input_features": torch.randn(4, 8, 16), "labels": torch.randint(3, 64, (4, 5))}


@pytest.mark.parametrize("build", [pytest.param(_t5, id="t5", marks=slow),
                                   pytest.param(_whisper, id="whisper", marks=slow)])
def test_encoder_decoder_given_only_labels_matches_eager(build) -> None:  # noqa: ANN001
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, inputs = build()
    want_loss = model(**inputs).loss
    want = eager_reference(model, want_loss)
    pipe = vf.compile(copy.deepcopy(model), example_inputs=inputs, stages=3,
                      micro_batch_size=2)
    loss = pipe.step(**inputs)
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-5, atol=1e-6)
    assert_grads(pipe.model, want, rtol=1e-4, atol=1e-6)


# -- outputs holding None; the loss_fn contract ---------------------------------------------


class LogitsAndNone(nn.Module):
    """nanoGPT's forward without targets: ``(logits, None)``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.c(torch.relu(self.b(torch.relu(self.a(x))))), None


def test_output_with_none_matches_eager() -> None:
    torch.manual_seed(0)
    model, x, y = LogitsAndNone(), torch.randn(8, 8), torch.randint(0, 4, (8,))

    def loss_fn(out: tuple[torch.Tensor, None], target: torch.Tensor) -> torch.Tensor:
        logits, loss = out
        assert loss is None
        return F.cross_entropy(logits, target)

    want_loss = loss_fn(model(x), y)
    want = eager_reference(model, want_loss)
    pipe = vf.compile(model, example_inputs=(x,), loss_fn=loss_fn, stages=2, micro_batch_size=4)
    torch.testing.assert_close(pipe.step(x, target=y), want_loss.detach())
    assert_grads(model, want)
    logits, none = pipe(x)
    assert none is None
    torch.testing.assert_close(logits, model(x)[0])


def test_loss_fn_gets_none_when_step_has_no_target() -> None:
    torch.manual_seed(0)
    model, x = LogitsAndNone(), torch.randn(8, 8)
    seen = []

    def loss_fn(out: tuple[torch.Tensor, None], target: torch.Tensor | None) -> torch.Tensor:
        seen.append((target, isinstance(out[0], torch.fx.Proxy)))
        return out[0].pow(2).mean()

    want_loss = loss_fn(model(x), None)
    want = eager_reference(model, want_loss)
    pipe = vf.compile(model, example_inputs=(x,), loss_fn=loss_fn, stages=2, micro_batch_size=4)
    torch.testing.assert_close(pipe.step(x), want_loss.detach())
    assert_grads(model, want)
    # one call per micro-batch, target None (the first step also traces it with torch.fx, to
    # see whether it mixes samples: runtime/loss_fn_mixing.py)
    assert [t for t, traced in seen[1:] if not traced] == [None, None]
    assert all(t is None for t, _ in seen)

    one_arg = vf.compile(model, example_inputs=(x,), loss_fn=lambda out: out[0].pow(2).mean(),
                         stages=2, micro_batch_size=4)
    torch.testing.assert_close(one_arg.step(x), want_loss.detach())
    with pytest.raises(vf.VarunaFxError, match="takes only the output"):
        one_arg.step(x, target=torch.zeros(8))

    needs_target = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=4,
                              loss_fn=lambda out, target: F.cross_entropy(out[0], target))
    with pytest.raises(vf.VarunaFxError, match="got no target"):
        needs_target.step(x)


# -- forward's defaults (issue 30): a tensor default not shaped like the batch is a constant,
# as torch.distributed.pipelining runs it; None defaults forward reads ----------------------


class Defaults(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, y: torch.Tensor = torch.full((64,), 0.5),  # noqa: B008
                z: torch.Tensor = torch.ones(1, 64), mask: torch.Tensor | None = None,  # noqa: B008
                ) -> torch.Tensor:
        h = self.a(x) + y
        if mask is None:
            mask = torch.ones(64)
        return self.b(h * mask) * z


@pytest.mark.parametrize("tracer", ["fx", "export", "auto"])
def test_constant_tensor_and_none_defaults_match_eager(tracer: str) -> None:
    torch.manual_seed(0)
    model, x = Defaults(), torch.randn(16, 64)
    reference = copy.deepcopy(model)
    want = eager_reference(reference, reference(x).pow(2).mean())
    pipe = vf.compile(model, example_inputs=(x,), loss_fn=lambda out, _: out.pow(2).mean(),
                      stages=2, micro_batch_size=4, tracer=tracer)
    loss = pipe.step(x)
    torch.testing.assert_close(loss, reference(x).pow(2).mean())
    assert_grads(model, want)
    torch.testing.assert_close(pipe(x), reference(x))


class PassedDefault(nn.Module):
    """torch.distributed.pipelining's own test model style (issue 42 item 11): a tensor
    default shaped like the batch and a None default, called with the tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor = torch.zeros(4, 8),  # noqa: B008
                z: torch.Tensor | None = None) -> torch.Tensor:
        h = self.a(x) + y
        if z is not None:
            h = h * z
        return self.b(torch.relu(h))


@pytest.mark.parametrize("tracer", tiered(["fx", "export", "auto"], ["fx"]))
def test_a_tensor_default_passed_beside_a_none_default_matches_eager(tracer: str) -> None:
    """fx gave the kept placeholder its tensor default (a constant of the graph) in the
    generated signature, ``def forward(self, x, y = _tensor_constant0)``: a raw NameError."""
    torch.manual_seed(0)
    model, x, y = PassedDefault(), torch.randn(4, 8), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    want = eager_reference(reference, reference(x, y).pow(2).mean())
    pipe = vf.compile(model, example_inputs=(x, y), loss_fn=lambda out, _: out.pow(2).mean(),
                      stages=2, micro_batch_size=2, tracer=tracer)
    torch.testing.assert_close(pipe.step(x, y), reference(x, y).pow(2).mean())
    assert_grads(model, want)
    torch.testing.assert_close(pipe(x, y), reference(x, y))
    assert "_tensor_constant" not in pipe.stages[0].code
    # left out, the batch-shaped default is refused, saying what to do
    with pytest.raises(vf.VarunaFxError, match="Pass 'y' in example_inputs"):
        vf.compile(PassedDefault(), example_inputs=(x,), stages=2, micro_batch_size=2,
                   loss_fn=lambda out, _: out.sum(), tracer=tracer)
