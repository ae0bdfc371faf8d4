"""Scaled dot-product attention written out (torch's "math" path), its dropout a callable.

Keyed draws (``ir/rng.py``) cannot reach inside a fused attention kernel: flash and
memory-efficient attention draw their dropout mask from the generator's state with no way to
key it per sample, so before this file an SDPA with dropout ran once per sample. The math path
takes the mask from outside: the attention probabilities are one tensor of shape
``(..., L, S)``, and ``dropout`` is applied to them in one batched call (a keyed mask drawn row
by row, applied at once). The arithmetic follows torch's own math backend
(``_scaled_dot_product_attention_math``): q and k each scaled by sqrt(scale), an additive mask
(causal or boolean masks as 0 / -inf), the "safe" softmax (a row masked everywhere gives zeros, not
NaN), then dropout, then the product with v.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def math_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_mask: torch.Tensor | None, is_causal: bool, scale: float | None,
              enable_gqa: bool, dropout: Callable[[torch.Tensor], torch.Tensor]
              ) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with ``dropout`` applied to the probabilities."""
    length, source = query.size(-2), key.size(-2)
    if scale is None:
        scale = 1.0 / math.sqrt(query.size(-1))
    if enable_gqa and query.dim() >= 3 and key.size(-3) != query.size(-3):
        repeats = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(repeats, dim=-3)
        value = value.repeat_interleave(repeats, dim=-3)
    root = math.sqrt(scale)  # as torch's math path: both sides scaled, for fp16's range
    scores = (query * root) @ (key * root).transpose(-2, -1)
    # masks are added (0 or -inf), as torch's math path does: the mask is built at its own
    # (small, broadcast) size and the addition's backward is the gradient itself
    if is_causal:
        attn_mask = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=scores.dtype,
                                    device=scores.device).masked_fill_(attn_mask.logical_not(),
                                                                       float("-inf"))
        scores = scores + attn_mask
    probabilities = torch.ops.aten._safe_softmax.default(scores, -1)
    return dropout(probabilities) @ value
