"""The user's example inputs bound to ``forward``'s parameters, checked for a batch dimension."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import InputError


@dataclass
class BoundInputs:
    """The user's example inputs bound to ``model.forward``'s parameters."""

    tensors: dict[str, torch.Tensor]  # graph inputs, in signature order
    constants: dict[str, Any] = field(default_factory=dict)  # non-tensor values given by the user

    @property
    def batch_size(self) -> int:
        return next(iter(self.tensors.values())).shape[0]



def bind_inputs(model: nn.Module, inputs: Any, kw_inputs: dict[str, Any] | None = None,
                *, what: str = "example_inputs",
                signature: inspect.Signature | None = None) -> BoundInputs:
    """Bind positional/keyword inputs to ``model.forward`` and check the batch dimension."""
    if isinstance(inputs, torch.Tensor):
        args, kwargs = (inputs,), {}
    elif isinstance(inputs, dict):
        args, kwargs = (), dict(inputs)
    elif isinstance(inputs, (tuple, list)):
        args, kwargs = tuple(inputs), {}
    else:
        raise InputError(
            f"{what} must be a tuple of positional arguments or a dict of keyword arguments "
            f"for {type(model).__name__}.forward, got {type(inputs).__name__}"
        )
    kwargs.update(kw_inputs or {})
    # every step binds its inputs: callers that already have the signature pass it
    signature = signature or inspect.signature(model.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise InputError(
            f"{what} do not match {type(model).__name__}.forward{signature}: {exc}"
        ) from None
    tensors: dict[str, torch.Tensor] = {}
    constants: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise InputError(
                f"{type(model).__name__}.forward takes *args/**kwargs ('{name}'); pass inputs "
                "that bind to named parameters, or wrap the model in a module with explicit ones"
            )
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                raise InputError(
                    f"{what}: argument '{name}' is a {str(value.layout).removeprefix('torch.')} "
                    "tensor; a pipeline splits every input along dim 0 into micro-batches and "
                    f"sends slices between stages, which needs dense tensors: pass "
                    f"{name}.to_dense() (or densify it inside forward from dense indices and "
                    "values)")
            tensors[name] = value
        elif value is None or isinstance(value, (bool, int, float, str)):
            constants[name] = value
        else:
            raise InputError(
                f"{what}: argument '{name}' is a {type(value).__name__}; inputs must be tensors "
                "(with the batch on dim 0) or plain constants (None, bool, int, float, str)"
            )
    if not tensors:
        raise InputError(f"{what} contain no tensor: give at least one batch tensor")
    batch = {n: (t.shape[0] if t.dim() > 0 else None) for n, t in tensors.items()}
    if None in batch.values():
        scalars = [n for n, b in batch.items() if b is None]
        raise InputError(
            f"{what}: {scalars} are 0-d tensors; every tensor input needs the batch on dim 0"
        )
    if len(set(batch.values())) > 1:
        sizes = ", ".join(f"{n}: {b}" for n, b in batch.items())
        raise InputError(
            f"{what}: tensors disagree on the batch size (dim 0): {sizes}; dim 0 of every "
            "tensor input must be the batch"
        )
    if 0 in batch.values():
        raise InputError(
            f"{what}: the batch (dim 0) is empty; give at least one sample"
        )
    return BoundInputs(tensors, constants)
