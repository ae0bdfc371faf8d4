"""Module state (buffers) that compile-time work must leave exactly as it found it.

Compiling runs the model's graph without the user asking for a forward: twice on fake tensors
(``annotate_shapes``) and, with ``profile=True``, for real to time it. An in-place buffer
update in the graph (BatchNorm's running statistics and ``num_batches_tracked``, a user's
``self.calls.add_(1)``) would then count runs eager PyTorch never did.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def buffers_kept(module: nn.Module) -> Iterator[None]:
    """Run the body, then put every buffer of ``module`` back to its value before it."""
    saved = []
    with torch.no_grad():
        for buffer in {id(b): b for b in module.buffers()}.values():
            saved.append((buffer, buffer._version, buffer.clone()))
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, version, value in saved:
                if buffer._version != version:  # mutated: restore (untouched ones cost nothing)
                    buffer.copy_(value)


class BatchNormMicroBatchWarning(UserWarning):
    """BatchNorm normalises each micro-batch by its own statistics, not the whole batch's."""


def warn_batchnorm(model: nn.Module, num_micro_batches: int) -> None:
    """Warn (at compile) when BatchNorm in training mode meets more than one micro-batch."""
    norms = [name for name, m in model.named_modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    if norms and num_micro_batches > 1:
        warnings.warn(
            f"{type(model).__name__} has BatchNorm ({', '.join(norms[:3])}"
            f"{', ...' if len(norms) > 3 else ''}) and the plan splits each batch into "
            f"{num_micro_batches} micro-batches: BatchNorm normalises and updates its running "
            "statistics per micro-batch, so training differs from eager on the whole batch. "
            "Compile with micro_batch_size equal to the batch for eager's numbers, or use "
            "GroupNorm/LayerNorm", BatchNormMicroBatchWarning, stacklevel=3)
