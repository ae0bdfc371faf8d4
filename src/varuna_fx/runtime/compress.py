"""Compressed pipeline boundaries: a boundary tensor encoded for the wire, decoded where it lands.

``compression=`` (``costs/wire.py``) is resolved by the planner into one mode per stage
boundary (``plan.compression``); a transfer from stage ``src`` to ``dst`` that crosses ranks is
sent under the strongest mode of the boundaries between them (:func:`transfer_mode`), its
activation forward and its gradient backward alike. Values passed between two stages of one
rank are never sent, so never compressed. Both runtimes apply exactly this code: the
distributed executor encodes before ``isend`` and decodes after the receive, the one-process
runtime decodes what it encodes (:func:`roundtrip`), so one process equals a distributed run.
Evaluation forwards (``pipe(x)``) send exact values.

* ``bf16``: a cast to bfloat16 and back (float32/float64 values; narrower ones go as they are).
* ``int8``: per row (the last dimension), ``scale = max|x| / 127`` and ``round(x / scale)`` in
  int8; one uint8 message holds the values, then the rows' scales (float32; float64 for a
  float64 tensor, whose magnitudes float32 cannot hold: 1e39 would overflow, 1e-50 vanish).
  Round to nearest, so every element is within ``scale / 2 = max|row| / 254`` of the original.
  A row holding an inf or NaN is sent with a NaN scale and decodes to NaNs, so an fp16
  overflow still shows as one (``pipe.found_inf``) and a NaN sample's loss stays NaN, as eager's.

Gradients are not error-fed-back: an activation gradient belongs to its micro-batch's samples,
and the next step's micro-batch in that slot holds other samples, so a carried residual would
add another sample's error instead of cancelling this one's (AQ-SGD's per-sample history fixes
that for fine-tuning, not for one-pass pretraining; ``docs/API.md``). Round to nearest keeps the
error unbiased to first order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..costs.wire import MODES

_FLOAT_WIDE = (torch.float32, torch.float64)
_FLOAT = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def applies(dtype: torch.dtype, mode: str) -> bool:
    """Whether ``mode`` changes a tensor of ``dtype`` (integers and narrow floats go whole)."""
    if mode == "bf16":
        return dtype in _FLOAT_WIDE
    if mode == "int8":
        return dtype in _FLOAT
    return False


def transfer_mode(compression: Sequence[str], src: int, dst: int) -> str:
    """The mode of a transfer between stages ``src`` and ``dst``: the strongest of the
    boundaries it crosses (a skip connection crosses several)."""
    lo, hi = sorted((src, dst))
    return max(compression[lo:hi], key=MODES.index, default="off")


def _rows(shape: Sequence[int]) -> tuple[int, int]:
    """(rows, elements per row): the last dimension is a row (a 0-d tensor is one row)."""
    numel = math.prod(shape)
    cols = shape[-1] if len(shape) and shape[-1] > 0 else 1
    return numel // cols, cols


def _scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype int8's per-row scales travel (and are computed) in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scale_bytes(dtype: torch.dtype) -> int:
    return 8 if dtype == torch.float64 else 4


def wire_spec(shape: Sequence[int], dtype: torch.dtype,
              mode: str) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype a boundary tensor travels as."""
    if not applies(dtype, mode):
        return tuple(shape), dtype
    if mode == "bf16":
        return tuple(shape), torch.bfloat16
    rows, _ = _rows(shape)
    return (math.prod(shape) + _scale_bytes(dtype) * rows,), torch.uint8


def wire_nbytes(shape: Sequence[int], dtype: torch.dtype, mode: str) -> int:
    """Bytes one such tensor puts on the wire."""
    wshape, wdtype = wire_spec(shape, dtype, mode)
    return math.prod(wshape) * torch.empty((), dtype=wdtype).element_size()


def encode(value: torch.Tensor, mode: str) -> torch.Tensor:
    """``value`` as the wire carries it under ``mode`` (contiguous)."""
    if not applies(value.dtype, mode):
        return value.contiguous()
    if mode == "bf16":
        return value.to(torch.bfloat16).contiguous()
    rows, cols = _rows(value.shape)
    x = value.detach().reshape(rows, cols).to(_scale_dtype(value.dtype))
    if not cols:
        scale = torch.ones(rows, 1, dtype=x.dtype, device=x.device)
    else:
        scale = x.abs().amax(dim=1, keepdim=True) / 127.0
        # An all-zero row takes any scale (1). A row with an inf or NaN is sent with a NaN
        # scale so every element decodes to NaN: ``NaN > 0`` is False, so the zero-row rule
        # alone would give a NaN row the scale 1 and send it as finite numbers.
        finite = torch.isfinite(x).all(dim=1, keepdim=True)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    q = torch.round(torch.nan_to_num(x / scale)).clamp_(-127, 127).to(torch.int8)
    nscale = _scale_bytes(value.dtype) * rows
    out = torch.empty(rows * cols + nscale, dtype=torch.uint8, device=value.device)
    out[:rows * cols].copy_(q.reshape(-1).view(torch.uint8))
    out[rows * cols:].copy_(scale.reshape(-1).view(torch.uint8))
    return out


def decode(wire: torch.Tensor, shape: Sequence[int], dtype: torch.dtype,
           mode: str) -> torch.Tensor:
    """The tensor of ``shape`` and ``dtype`` a received ``wire`` stands for."""
    if not applies(dtype, mode):
        return wire
    if mode == "bf16":
        return wire.to(dtype)
    rows, cols = _rows(shape)
    q = wire[:rows * cols].view(torch.int8).reshape(rows, cols)
    scale = wire[rows * cols:].clone().view(_scale_dtype(dtype)).reshape(rows, 1)
    return (q.to(scale.dtype) * scale).to(dtype).reshape(tuple(shape))


def roundtrip(value: torch.Tensor, mode: str) -> torch.Tensor:
    """What the receiving stage gets for ``value`` (the one-process runtime's network)."""
    if not applies(value.dtype, mode):
        return value
    return decode(encode(value, mode), value.shape, value.dtype, mode)
