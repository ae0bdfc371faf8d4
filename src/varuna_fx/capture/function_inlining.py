"""Whether torch.export may inline a custom ``torch.autograd.Function``: only where its own
backward gives the gradients autograd gives through its forward.

torch.export traces a Function's ``forward`` into the graph and drops its ``backward``. That
is right for a Function whose backward only computes the same gradients faster (Bloom's
``GeLUFunction``, a fused kernel's hand-written derivative) and silently wrong for one whose
backward is the point (a straight-through estimator's, whose forward ``round`` has zero
gradient). After export, each Function it met is run once on random inputs of the shapes it
saw (dim 0 cut to 2 where a tensor is large), with its backward and with autograd through its
forward, and the gradients compared; a difference, or a Function this check cannot run, is
refused by ``trace_export``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import Function, FunctionCtx

from .autograd_functions import Applied, TensorArg

_LARGE = 1 << 22  # elements: above this a tensor's dim 0 is cut to 2 for the check


def inlining_differs(applied: Applied) -> str | None:
    """Why inlining ``applied`` would change the gradients (or cannot be checked), or None."""
    generator = torch.Generator().manual_seed(0)
    try:
        args = [_real(a, generator) for a in applied.args]
        # the same random weighting of the outputs for both
        own = _gradients(applied.cls, args, torch.Generator().manual_seed(1), inline=False)
        inlined = _gradients(applied.cls, args, torch.Generator().manual_seed(1), inline=True)
    except Exception as exc:  # noqa: BLE001 - a Function the check cannot run is not inlined
        return f"its backward could not be compared with autograd's ({type(exc).__name__}: " \
               f"{str(exc).splitlines()[0] if str(exc) else ''})"
    for i, (a, b) in enumerate(zip(own, inlined)):
        if (a is None) != (b is None) or (a is not None and not torch.allclose(
                a, b, rtol=1e-4, atol=1e-5)):
            return f"its backward gives other gradients than autograd through its forward " \
                   f"(argument {i})"
    return None


def _real(arg: Any, generator: torch.Generator) -> Any:
    if not isinstance(arg, TensorArg):
        return arg
    shape = list(arg.shape)
    if shape and torch.Size(shape).numel() > _LARGE:
        shape[0] = min(shape[0], 2)
    if arg.dtype.is_floating_point or arg.dtype.is_complex:
        t = torch.randn(shape, generator=generator).to(arg.dtype)
        return t.requires_grad_(arg.requires_grad)
    if arg.dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    return torch.zeros(shape, dtype=arg.dtype)


def _gradients(cls: type[Function], args: list[Any], generator: torch.Generator,
               inline: bool) -> list[torch.Tensor | None]:
    """The gradients of a random weighting of the outputs with respect to each tensor argument
    that requires grad: through the Function (``inline=False``) or through its forward."""
    inputs = [a.detach().clone().requires_grad_(a.requires_grad)
              if isinstance(a, torch.Tensor) else a for a in args]
    # a Function may write its inputs in place (ctx.mark_dirty): give it non-leaf copies
    given = [a * 1 if isinstance(a, torch.Tensor) and a.requires_grad else a for a in inputs]
    with torch.enable_grad():
        if not inline:
            out = cls.apply(*given)
        elif _has_setup_context(cls):
            out = cls.forward(*given)
        else:
            out = cls.forward(FunctionCtx(), *given)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])
                if isinstance(o, torch.Tensor) and o.requires_grad]
        wanted = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
        if not outs or not wanted:
            return []
        weights = [torch.randn(o.shape, generator=generator).to(o.dtype) for o in outs]
        total = sum((o * w).sum() for o, w in zip(outs, weights))
        return list(torch.autograd.grad(total, wanted, allow_unused=True))


def _has_setup_context(cls: type[Function]) -> bool:
    """A Function written with ``setup_context`` takes no ctx in ``forward``."""
    from torch.autograd.function import _SingleLevelFunction

    return cls.setup_context is not _SingleLevelFunction.setup_context  # type: ignore[comparison-overlap]
