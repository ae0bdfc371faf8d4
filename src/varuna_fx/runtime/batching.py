"""Splitting a batch into micro-batches, and finding the loss in a model's output."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..errors import InputError
from ..ir.nodes import TensorInfo


def split_batch(tensors: dict[str, torch.Tensor], micro_batch_size: int,
                what: str = "batch") -> list[dict[str, torch.Tensor]]:
    sizes = {name: t.shape[0] for name, t in tensors.items()}
    batch = next(iter(sizes.values()))
    if len(set(sizes.values())) > 1:
        raise InputError(f"{what}: tensors disagree on the batch size (dim 0): {sizes}")
    if batch % micro_batch_size:
        raise InputError(
            f"{what}: batch size {batch} is not divisible by the micro-batch size "
            f"{micro_batch_size}; pass a batch that is a multiple of {micro_batch_size} or "
            "compile with another micro_batch_size"
        )
    count = batch // micro_batch_size
    chunks = {name: t.split(micro_batch_size) for name, t in tensors.items()}
    return [{name: chunks[name][i] for name in tensors} for i in range(count)]


def split_target(target: Any, micro_batch_size: int, count: int) -> list[Any]:
    if target is None:
        return [None] * count
    leaves, spec = pytree.tree_flatten(target)
    pieces = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            if leaf.shape[0] != micro_batch_size * count:
                raise InputError(
                    f"target has batch size {leaf.shape[0]} but the inputs have "
                    f"{micro_batch_size * count}; dim 0 of the target must be the batch"
                )
            pieces.append(leaf.split(micro_batch_size))
        else:
            pieces.append([leaf] * count)
    return [pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(count)]


def extract_loss(output: Any, loss_fn: Callable[..., torch.Tensor] | None,
                 target: Any) -> torch.Tensor:
    """The scalar loss of one micro-batch: ``loss_fn(output, target)`` or the model's own."""
    if loss_fn is not None:
        loss = call_loss_fn(loss_fn, output, target)
    elif isinstance(output, torch.Tensor):
        loss = output
    elif hasattr(output, "loss") and output.loss is not None:
        loss = output.loss
    elif isinstance(output, dict) and "loss" in output:
        loss = output["loss"]
    else:
        raise InputError(
            f"the model returned a {type(output).__name__} with no loss: pass loss_fn=... to "
            "vf.compile, or return a 0-d tensor, an object with .loss or a dict with 'loss'"
        )
    if loss_fn is None and isinstance(loss, torch.Tensor) and loss.dim() != 0:
        raise InputError(
            f"the model returned a tensor of shape {tuple(loss.shape)}, not a loss: pass "
            "loss_fn=... to vf.compile, or make the model return a 0-d loss"
        )
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InputError(f"the loss must be a 0-d tensor, got {shape}: reduce it (e.g. .mean())")
    return loss


def takes_target(loss_fn: Callable[..., Any]) -> bool:
    """Whether ``loss_fn`` accepts a second positional argument (the target)."""
    try:
        params = list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: assume (output, target)
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def call_loss_fn(loss_fn: Callable[..., Any], output: Any, target: Any) -> Any:
    """The contract: ``loss_fn(output, target)``, with ``target=None`` when ``step`` got none;
    a ``loss_fn`` of one parameter is called ``loss_fn(output)`` (then no target is allowed)."""
    if not takes_target(loss_fn):
        if target is not None:
            raise InputError(
                "pipe.step got a target but loss_fn takes only the output: define "
                "loss_fn(output, target), or call step without target="
            )
        return loss_fn(output)
    if target is not None:
        return loss_fn(output, target)
    try:
        return loss_fn(output, None)
    except (TypeError, AttributeError) as exc:
        raise InputError(
            f"loss_fn(output, None) failed ({type(exc).__name__}: {exc}): pipe.step got no "
            "target; pass target=... to pipe.step, or make loss_fn handle target=None"
        ) from exc


def check_batch_shapes(tensors: dict[str, torch.Tensor], expected: dict[str, TensorInfo],
                       batch: int, split: str = "") -> None:
    """Every input must have exactly the planned shape and dtype for a batch of ``batch``.

    The distributed runtime calls this on every rank before any communication: peers size
    their receive buffers from the plan, so another shape would otherwise surface as a size
    mismatch inside the transport or a hang. Every rank gets the same batch, so all raise."""
    for name, tensor in tensors.items():
        planned = expected.get(name)
        if planned is None:
            continue
        shape = _planned_shape(planned, batch)
        if tuple(tensor.shape) != shape:
            got = tuple(tensor.shape)
            if got[:1] != shape[:1] and got[1:] == shape[1:]:
                raise InputError(
                    f"input {name!r} has batch size {got[0]} but the plan runs {batch} samples "
                    f"per replica{split}; pass {batch} rows (this replica's share of the "
                    "global batch), or compile for this batch size"
                )
            raise InputError(
                f"input {name!r} has shape {got} but the plan was compiled for {shape}: pass "
                "inputs shaped like example_inputs, or compile again for the new shape"
            )
        if tensor.dtype != planned.dtype:
            raise InputError(
                f"input {name!r} is {tensor.dtype} but the plan was compiled for "
                f"{planned.dtype}; convert it or compile again"
            )


def check_sample_shapes(tensors: dict[str, torch.Tensor],
                        expected: dict[str, TensorInfo]) -> None:
    """Any batch size, but every other dimension and the dtype as compiled: the stage code
    has the example's sizes (a sequence length, say) built in."""
    for name, tensor in tensors.items():
        planned = expected.get(name)
        if planned is None:
            continue
        want = planned.concrete_shape(tensor.shape[0])
        if tuple(tensor.shape[1:]) != want[1:] or tensor.dim() != len(want):
            raise InputError(
                f"input {name!r} has shape {tuple(tensor.shape)} but the pipeline was compiled "
                f"for (batch, {', '.join(map(str, want[1:]))}): only the batch size may change; "
                "pad the input, or compile again with example inputs of the new shape"
            )
        if tensor.dtype != planned.dtype:
            raise InputError(
                f"input {name!r} is {tensor.dtype} but the pipeline was compiled for "
                f"{planned.dtype}; convert it or compile again"
            )


@functools.lru_cache(maxsize=256)
def _planned_shape(planned: TensorInfo, batch: int) -> tuple[int, ...]:
    return planned.concrete_shape(batch)  # a sympy substitution: worth caching per step


def micro_batch_loss(output: Any, loss_fn: Callable[..., torch.Tensor] | None, target: Any,
                     count: int, autocast: Callable[[], Any],
                     scale: float = 1.0, weight: float | None = None,
                     weighs: Callable[[torch.Tensor], bool] | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss to report, the loss to back-propagate): the latter is divided by the number
    of micro-batches (the step's loss is their mean) and multiplied by the fp16 loss scale.
    ``weight``: this micro-batch's share of the step's loss instead of ``1/count`` (a mean
    over kept targets, ``runtime/loss_weights.py``); the reported loss is scaled so that the mean of
    the reported losses is the weighted sum. ``weighs``: whether ``weight`` applies to the
    loss found (a ``loss_fn`` that returned the model's own mean loss), else ``1/count``."""
    with autocast():
        raw = extract_loss(output, loss_fn, target)
    if weight is not None and weighs is not None and not weighs(raw):
        weight = None
    if weight is None:
        seed, report = raw / count, raw.detach()
    elif weight == 0:  # no label kept: its mean is nan (0/0), its share nothing
        seed, report = raw * 0.0, torch.zeros_like(raw.detach())
    else:
        seed, report = raw * weight, raw.detach() * (weight * count)
    return report, seed * scale if scale != 1.0 else seed
