"""Custom ``torch.autograd.Function``s keep their own backward in the captured graph.

Left alone, both tracers inline a Function: torch.fx runs its ``forward`` on proxies (the ops
land in the graph, ``backward`` is never seen) and torch.export traces ``forward`` into aten
ops. Either way the pipeline's gradients would be autograd's through the forward -- all zero
for a straight-through estimator (``round``), and whatever autograd makes of a scan that
writes its own buffer in place -- with no word.

Under torch.fx each call of a user's Function becomes one ``call_function`` node whose target
calls ``Function.apply`` at run time (:func:`opaque_call`), so the stage runs the real Function
and autograd calls the user's backward. torch.export cannot keep such a call (non-strict
export traces below autograd): a Function it reaches is checked once on random inputs of the
shapes it saw, and refused, naming it, unless its backward gives autograd's gradients through
its forward (Bloom's GeLU, a backward written only for speed; ``function_inlining.py``). torch's own
Functions (``torch.utils.checkpoint`` and the like) are traced as before; capture handles
those it must (``untraced.py``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.autograd.function import Function

from ..ir.nodes import info as node_info

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep

# one callable per Function class, so that every capture of it names the same target
_CALLS: dict[type, Callable[..., Any]] = {}


def opaque_call(cls: type[Function]) -> Callable[..., Any]:
    """The graph's target for ``cls.apply``: a plain function (fx writes it into the
    generated code as a global) that applies the Function when the stage runs."""
    call = _CALLS.get(cls)
    if call is None:
        def call(*args: Any, **kwargs: Any) -> Any:
            return cls.apply(*args, **kwargs)

        call.__name__ = call.__qualname__ = f"{cls.__name__}_apply"
        call.__doc__ = f"{cls.__module__}.{cls.__qualname__}.apply, its backward the user's"
        call.autograd_function = cls  # type: ignore[attr-defined]
        _CALLS[cls] = call
    return call


def function_of(target: Any) -> type[Function] | None:
    """The Function class a node's target applies (an :func:`opaque_call`), or None."""
    return getattr(target, "autograd_function", None)


def mark_writes(gm: fx.GraphModule) -> None:
    """A Function may write its inputs in place (``ctx.mark_dirty``), which nothing outside
    its code shows: its stage then works on copies of what it receives (``split_stages``), as
    for any write in place, since a received activation is an autograd leaf, which autograd
    does not let a Function write. Later reads are not rewired to its result (it need not
    return its input)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and function_of(node.target) is not None:
            node_info(node).mutates = True


def _is_users(cls: type) -> bool:
    return not cls.__module__.startswith("torch.")


@dataclass
class Applied:
    """A user's Function that torch.export traced (and so inlined): where, and its arguments
    with each tensor as (shape, dtype) -- the fakes are gone once export returns."""

    cls: type[Function]
    where: str
    args: list[Any]

    def __str__(self) -> str:
        return f"{self.cls.__qualname__} ({self.where})"


@contextlib.contextmanager
def functions_kept() -> Iterator[list[Applied]]:
    """While the body runs, a user's Function applied to an fx proxy becomes one opaque node;
    applied to the fake tensors of torch.export it is recorded (:class:`Applied`) and run as
    usual, so that what export made of it can be checked afterwards
    (``function_inlining.py``)."""
    original = Function.__dict__["apply"]
    found: list[Applied] = []

    def apply(cls: type[Function], *args: Any, **kwargs: Any) -> Any:
        if _is_users(cls):
            leaves = pytree.tree_leaves((args, kwargs))
            proxy = next((a for a in leaves if isinstance(a, fx.Proxy)), None)
            if proxy is not None:
                return proxy.tracer.create_proxy("call_function", opaque_call(cls), args,
                                                 kwargs)
            if any(_is_traced(a) for a in leaves):
                found.append(Applied(cls, _caller(), [_described(a) for a in args]))
        return original.__func__(cls, *args, **kwargs)

    Function.apply = classmethod(apply)  # type: ignore[assignment]
    try:
        yield found
    finally:
        Function.apply = original  # type: ignore[assignment]


@dataclass(frozen=True)
class TensorArg:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def _described(value: Any) -> Any:
    """A tensor argument as its :class:`TensorArg` (symbolic sizes at their example value);
    anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    shape = tuple(int(d.node.hint) if isinstance(d, torch.SymInt) else int(d)
                  for d in value.shape)
    return TensorArg(shape, value.dtype, value.requires_grad)


def _is_traced(value: Any) -> bool:
    """A tensor torch.export traces with (fake, functional), not a real one."""
    if not isinstance(value, torch.Tensor):
        return False
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(value, (FakeTensor, FunctionalTensor)) or \
        torch._C._functorch.is_functorch_wrapped_tensor(value)


def _caller() -> str:
    """file:line of the model's code that applied the Function."""
    frame = sys._getframe(2)
    while frame.f_back is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR)
                                        or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"
