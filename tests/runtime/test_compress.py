"""Compressed pipeline boundaries in one process (issue 31 item 2): the codec's error bounds,
"off" equal to eager bit for bit, and every setting training a tiny GPT."""

from __future__ import annotations

import pytest
import torch

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.runtime.compress import decode, encode, roundtrip, transfer_mode, wire_nbytes

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


@pytest.mark.parametrize("shape", [(4, 8, 32), (3, 5), (7,), (2, 0, 4), ()])
def test_int8_is_within_half_a_step_of_each_row_and_bf16_within_its_precision(
        shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * torch.logspace(-6, 3, shape[-1] if shape else 1)
    if x.dim() >= 2 and x.numel():
        x[0].zero_()  # an all-zero row: any scale, exactly zero back
    back = roundtrip(x, "int8")
    assert back.shape == x.shape and back.dtype == x.dtype
    rows = x.reshape(-1, x.shape[-1] if x.dim() else 1)
    bound = rows.abs().amax(dim=1, keepdim=True) / 254 * (1 + 1e-6)
    assert torch.all((back.reshape(rows.shape) - rows).abs() <= bound)
    assert wire_nbytes(x.shape, x.dtype, "int8") == x.numel() + 4 * rows.shape[0]
    half = roundtrip(x, "bf16")
    assert torch.all((half - x).abs() <= x.abs() * 2**-8)
    assert wire_nbytes(x.shape, x.dtype, "bf16") == 2 * x.numel()


def test_the_codec_keeps_what_it_must() -> None:
    ints = torch.arange(6)
    assert roundtrip(ints, "int8") is ints and roundtrip(ints, "bf16") is ints
    x = torch.randn(3, 4)
    assert roundtrip(x, "off") is x
    x[1, 2] = float("inf")  # an fp16 overflow still shows as one
    assert not torch.isfinite(roundtrip(x, "int8")[1]).any()
    assert torch.isfinite(roundtrip(x, "int8")[0]).all()
    wire = encode(x.double(), "int8")  # float64 decodes back to float64
    assert decode(wire, x.shape, torch.float64, "int8").dtype == torch.float64
    # a skip connection crosses several boundaries: the strongest of them
    assert transfer_mode(("off", "bf16", "int8"), 0, 2) == "bf16"
    assert transfer_mode(("off", "bf16", "int8"), 3, 1) == "int8"
    assert transfer_mode((), 0, 1) == "off"


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, CFG.vocab_size, (8, CFG.block_size + 1),
                         generator=torch.Generator().manual_seed(1))
    return data[:, :-1], data[:, 1:]


def test_off_equals_eager_bit_for_bit() -> None:
    """One micro-batch through two stages runs eager's very operations: with compression
    "off" (the default, and said so) nothing in between may change a bit."""
    x, y = _batch()
    torch.manual_seed(0)
    model = GPT(CFG)
    eager = lm_loss(model(x), y)
    eager.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for keywords in ({}, {"compression": "off", "replica_sync": "exact"}):
        pipe = vf.compile(model, example_inputs=(x,), loss_fn=lm_loss, stages=2,
                          micro_batch_size=8, **keywords)
        assert pipe.plan.compression == ("off",) and not pipe.plan.departs_from_eager
        pipe.zero_grad()
        loss = pipe.step(x, target=y)
        assert torch.equal(torch.as_tensor(loss, dtype=eager.dtype), eager.detach())
        for n, p in pipe.named_parameters():
            assert torch.equal(p.grad, expected[n]), n


@pytest.mark.parametrize("compression", ["bf16", "int8"])
def test_each_compression_trains_and_departs_by_design(compression: str) -> None:
    x, y = _batch()
    torch.manual_seed(0)
    pipe = vf.compile(GPT(CFG), example_inputs=(x,), loss_fn=lm_loss, stages=2,
                      micro_batch_size=2, compression=compression)
    assert pipe.plan.compression == (compression,) and pipe.plan.departs_from_eager
    assert "departs from eager numerics" in str(pipe.plan)
    opt = pipe.optimizer(torch.optim.AdamW, lr=3e-3)
    losses = []
    for _ in range(4):
        pipe.zero_grad()
        losses.append(float(pipe.step(x, target=y)))
        opt.step()
    assert losses[-1] < losses[0] - 0.1, losses


def test_int8_keeps_a_nan_and_float64_magnitudes() -> None:
    """What eager has, the wire keeps (issue 42 item 4): a row holding a NaN decodes to NaNs
    (its scale was NaN, and ``NaN > 0`` used to pick the all-zero row's scale of 1, sending
    finite zeros), and float64 values beyond float32's range (or below its normal range) keep
    the documented bound ``max|row| / 254``: their rows are quantised and scaled in float64."""
    x = torch.randn(3, 4)
    x[1, 2] = float("nan")
    back = roundtrip(x, "int8")
    assert torch.isnan(back[1]).all() and torch.isfinite(back[[0, 2]]).all()
    for magnitude in (1e39, 1e300, 1e-50):
        big = torch.tensor([[1.0, -0.5, 0.25, 0.0], [3.0, 2.0, -1.0, 0.5]],
                           dtype=torch.float64) * magnitude
        back = roundtrip(big, "int8")
        assert torch.isfinite(back).all(), magnitude
        bound = big.abs().amax(dim=1, keepdim=True) / 254 * (1 + 1e-9)
        assert torch.all((back - big).abs() <= bound), magnitude
    assert wire_nbytes((2, 4), torch.float64, "int8") == 8 + 8 * 2  # float64 scales


def test_a_nan_sample_keeps_the_loss_nan_under_int8() -> None:
    """Eager's loss over a batch with a NaN sample is NaN; int8 boundaries must not hide it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                                torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 4)
    x[1, 0] = float("nan")

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(out, target)

    y = torch.zeros(4, 1)
    assert torch.isnan(loss_fn(model(x), y))
    pipe = vf.compile(model, example_inputs=(x,), loss_fn=loss_fn, stages=2,
                      micro_batch_size=4, compression="int8")
    assert torch.isnan(torch.as_tensor(pipe.step(x, target=y)))
