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
import torch.fx as fx
from torch import nn

from .ir import info


@contextlib.contextmanager
def buffers_kept(module: nn.Module) -> Iterator[None]:
    """Run the body, then put every buffer of ``module`` back to its value before it."""
    saved = []
    with torch.no_grad():
        for buffer in {id(b): b for b in module.buffers()}.values():
            saved.append((buffer, buffer.clone()))
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:  # all: BatchNorm's kernel writes without a version bump
                buffer.copy_(value)


class MicroBatchStateWarning(UserWarning):
    """Module state updated per micro-batch (BatchNorm statistics, in-place buffer writes)
    cannot follow eager on the whole batch."""


def written_buffer(node: fx.Node) -> str | None:
    """The attribute path of the buffer an in-place node writes (``self.calls.add_(1)``,
    or ``add_`` in ``self.ema.mul_(0.9).add_(v)``), else None."""
    if not info(node).mutates:
        return None
    base = node.args[0] if node.args else None
    while isinstance(base, fx.Node) and base.op in ("call_method", "call_function") \
            and base.args:
        base = base.args[0]  # views and earlier writes of the same tensor
    return str(base.target) if isinstance(base, fx.Node) and base.op == "get_attr" else None


def mutated_buffers(gm: fx.GraphModule) -> list[str]:
    """Buffers the graph writes in place (``self.calls.add_(1)``), by the attribute path."""
    found = [written_buffer(node) for node in gm.graph.nodes]
    return list(dict.fromkeys(b for b in found if b is not None))


def warn_micro_batch_state(model: nn.Module, gm: fx.GraphModule,
                           num_micro_batches: int) -> None:
    """Warn (at compile) when state updated per forward meets more than one micro-batch."""
    if num_micro_batches <= 1:
        return
    norms = [name for name, m in model.named_modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    if norms:
        warnings.warn(
            f"{type(model).__name__} has BatchNorm ({', '.join(norms[:3])}"
            f"{', ...' if len(norms) > 3 else ''}) and the plan splits each batch into "
            f"{num_micro_batches} micro-batches: BatchNorm normalises and updates its running "
            "statistics per micro-batch, so training differs from eager on the whole batch. "
            "Compile with micro_batch_size equal to the batch for eager's numbers, or use "
            "GroupNorm/LayerNorm", MicroBatchStateWarning, stacklevel=3)
    written = [b for b in mutated_buffers(gm)  # torch.export: BatchNorm's own counter
               if b.rpartition(".")[0] not in norms]
    if written:
        warnings.warn(
            f"{type(model).__name__} writes buffers in place ({', '.join(written[:3])}) and the "
            f"plan splits each batch into {num_micro_batches} micro-batches: they are written "
            "once per micro-batch, where eager writes once per batch. Compile with "
            "micro_batch_size equal to the batch for eager's numbers",
            MicroBatchStateWarning, stacklevel=3)
