"""The random calls stage code makes keyed without a mode: dropout and attention with dropout.

``split_stages`` replaces a node that is one plain dropout (``nn.Dropout``, ``F.dropout``,
``aten.dropout``) or one ``scaled_dot_product_attention`` whose dropout draws by a call of the
keyed function here, which draws the very numbers the modes of ``ir/rng.py`` draw for the same
call (the same seeds, the same kernels, the same rows) without entering them (a mode's cost:
bench/RESULTS.md, "Keyed dropout without the dispatch mode"). Each draws its mask row by
row (one generator seed per sample) and applies it to the whole micro-batch in one call; an
attention runs torch's math path on the whole micro-batch (``ir/attention_math.py``).
Outside a worker (no key), or where nothing is drawn (p of 0, eval), each is the plain call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from .rng import attention_arguments, current_key, draw_seeds, keyed_noise

_SDPA = (torch.nn.functional.scaled_dot_product_attention,
         torch.ops.aten.scaled_dot_product_attention.default)


def direct_call(root: torch.nn.Module, node: torch.fx.Node) -> bool:
    """Whether ``node`` is one dropout or attention call stage code can run keyed directly."""
    if node.op == "call_module":
        return type(root.get_submodule(str(node.target))) is torch.nn.Dropout
    return node.op == "call_function" and keyed_function(node.target) is not None


def keyed_function(target: Any) -> Any:
    """The keyed function to call instead of the function ``target`` (or None)."""
    if target is torch.nn.functional.dropout:
        return keyed_functional_dropout
    if target is torch.dropout or target is torch.ops.aten.dropout.default:
        return keyed_aten_dropout
    if target in _SDPA:
        return keyed_sdpa
    return None


@torch.fx.wrap
def keyed_module_dropout(first_op: int, per_sample: tuple[bool, ...], module: torch.nn.Module,
                         x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for an ``nn.Dropout``, keyed: its settings as they are now."""
    return keyed_dropout(first_op, per_sample, x, module.p, module.training, module.inplace)


@torch.fx.wrap
def keyed_functional_dropout(first_op: int, per_sample: tuple[bool, ...], input: torch.Tensor,
                             p: float = 0.5, training: bool = True,
                             inplace: bool = False) -> torch.Tensor:
    """``F.dropout(input, p, training, inplace)``, keyed."""
    return keyed_dropout(first_op, per_sample, input, p, training, inplace)


@torch.fx.wrap
def keyed_aten_dropout(first_op: int, per_sample: tuple[bool, ...], input: torch.Tensor,
                       p: float, train: bool) -> torch.Tensor:
    """``torch.dropout(input, p, train)`` (``aten.dropout``, what torch.export records), keyed."""
    return keyed_dropout(first_op, per_sample, input, p, train)


def keyed_dropout(first_op: int, per_sample: tuple[bool, ...], x: torch.Tensor, p: float,
                  training: bool, inplace: bool = False) -> torch.Tensor:
    """Eager's dropout with each row's mask drawn as the dispatch mode draws it
    (``keyed_noise``): op ``first_op``, per sample when compile said so and ``x``'s dim 0 is
    the micro-batch; the mask multiplies the whole tensor at once. Outside a worker (no key),
    or where eager draws nothing (p of 0 or 1, eval, an empty tensor): plain ``F.dropout``."""
    key = current_key()
    if key is None or not training or p == 0 or p == 1 or x.numel() == 0:
        return torch.nn.functional.dropout(x, p, training, inplace)
    per_row = bool(per_sample and per_sample[0] and x.dim() and x.shape[0] == key.batch)
    noise = keyed_noise(x, p, draw_seeds(key, first_op, per_row))
    return x.mul_(noise) if inplace else x * noise


@torch.fx.wrap
def keyed_sdpa(first_op: int, per_sample: tuple[bool, ...], *args: Any,
               **kwargs: Any) -> torch.Tensor:
    """``F.scaled_dot_product_attention(*args, **kwargs)`` (or aten's, the same arguments),
    keyed where its dropout draws: torch's math path on the whole micro-batch, the mask on the
    probabilities drawn row by row (what ``rng._KeyedAttention`` runs in eager)."""
    call = attention_arguments(*args, **kwargs)
    key = current_key()
    if key is None or call.dropout_p == 0:
        return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)
    per_row = bool(per_sample and per_sample[0] and call.batch == key.batch)
    return call.run(draw_seeds(key, first_op, per_row))
