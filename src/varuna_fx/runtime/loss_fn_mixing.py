"""Whether a ``loss_fn`` mixes samples (an in-batch contrastive loss): found on fake tensors.

A ``loss_fn`` runs outside the captured graph, on each micro-batch's output and target. On the
first step, the last stage runs it once more on fake tensors of the micro-batch's shapes at two
batch sizes (no memory, no compute), recording every aten operation it calls; the two records
say which dimensions of each value scale with the batch, and ``passes/sample_mixing.py``'s
analysis finds statistics over the batch, batch x batch products and positions in the batch,
as for the model's own graph. A ``loss_fn`` whose operations differ between the two runs
(control flow on values) is not judged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..passes.sample_mixing import INDEX, Finding, Op, find_sample_mixing, kind_of_call


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        # (overload, tensors read, tensors made, (name, args, kwargs), indexes by a tensor)
        self.calls: list[tuple[Any, list[torch.Tensor], list[torch.Tensor], tuple, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        index = args[1] if len(args) > 1 else None
        first = index[0] if isinstance(index, (list, tuple)) and index else None
        self.calls.append((func, inputs, outputs, (func._overloadpacket.__name__, args, kwargs),
                           isinstance(first, torch.Tensor)))
        return out


def _run(loss_fn: Callable[..., Any], output: Any, target: Any, b: int, size: int
         ) -> tuple[list, list[torch.Tensor], Any]:
    """The recorded calls of ``loss_fn`` on fake copies whose batch (dim 0 == b) is ``size``."""
    def fake(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        shape = (size, *t.shape[1:]) if t.dim() and t.shape[0] == b else tuple(t.shape)
        return torch.zeros(shape, dtype=t.dtype)  # (a fake tensor: inside FakeTensorMode)
    recorder = _Recorder()
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake_output, fake_target = pytree.tree_map(fake, (output, target))
        leaves = [t for t in pytree.tree_leaves((fake_output, fake_target))
                  if isinstance(t, torch.Tensor)]
        with recorder:
            loss = loss_fn(fake_output, fake_target)
    return recorder.calls, leaves, loss


def loss_fn_findings(loss_fn: Callable[..., Any], output: Any, target: Any,
                     batch: int) -> list[Finding]:
    """Where ``loss_fn`` mixes the samples of a micro-batch of ``batch`` samples; [] when it
    does not, or when it cannot be judged (it failed on fake tensors, or ran other
    operations at another batch size)."""
    try:
        first, leaves1, loss1 = _run(loss_fn, output, target, batch, batch)
        second, leaves2, loss2 = _run(loss_fn, output, target, batch, 2 * batch + 1)
    except Exception:  # noqa: BLE001 - a loss_fn fake tensors cannot run: not judged
        return []
    if len(first) != len(second) or [c[0] for c in first] != [c[0] for c in second]:
        return []
    dims: dict[int, int] = {}

    def scaling(a: torch.Tensor, c: torch.Tensor) -> int:
        if a.dim() != c.dim():
            return 0
        return sum(1 for x, y in zip(a.shape, c.shape) if x != y)

    for a, c in zip(leaves1, leaves2):
        dims[id(a)] = scaling(a, c)
    ops: list[Op] = []
    for k, (one, two) in enumerate(zip(first, second)):
        func, ins, outs, (name, args, kwargs), index_first = one
        for a, c in zip(outs, two[2]):
            dims[id(a)] = scaling(a, c)
        for t in ins:
            dims.setdefault(id(t), 0)
        kind = kind_of_call(func, args, kwargs)
        for j, out in enumerate(outs or [None]):
            ops.append(Op(
                name=f"{name}_{k}_{j}", kind=kind, inputs=tuple(id(t) for t in ins),
                output=id(out) if out is not None else -(k + 1),
                input_batch_dims=tuple(dims[id(t)] for t in ins),
                output_batch_dims=dims.get(id(out), -1) if out is not None else -1,
                where="", index_first=kind == INDEX and index_first))
    results = [id(t) for t in pytree.tree_leaves(loss1) if isinstance(t, torch.Tensor)]
    del loss2
    where = _defined_at(loss_fn)
    return [Finding(f.op, f.reason, where) for f in find_sample_mixing(ops, results)]


def _defined_at(function: Any) -> str:
    try:
        function = inspect.unwrap(function)
        return f"{inspect.getsourcefile(function)}:{inspect.getsourcelines(function)[1]}"
    except (TypeError, OSError):
        return ""
