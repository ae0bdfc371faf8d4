"""ZeRO-1: optimizer state sharded over a stage's D data-parallel replicas.

``pipe.optimizer(cls, params, **defaults)`` with sharding on flattens this rank's trainable
parameters into buckets: per (param group, dtype), ~25 MB each, padded to a multiple of D.
The parameters' ``.data`` become views of the bucket's flat buffer, so replica ``r``'s shard
(elements ``[r*s, (r+1)*s)``) is one ``nn.Parameter`` viewing that same memory; the user's
optimizer class is built over those shards (one list per param group, so groups, their
hyperparameters and LR schedulers stay as the user made them) and updates them in place.

Per step:

* the gradients are averaged over the replicas by grad_sync's all-reduce, as without sharding,
  so ``p.grad`` is what it is in eager data parallelism (the replica-averaged gradient) for
  everything a training loop does with it: ``torch.nn.utils.clip_grad_norm_``, reading or
  editing it, accumulating over several ``pipe.step`` calls;
* ``opt.step()`` first copies each shard's slice of the parameters' gradients as they are then
  into the shard's ``.grad`` (a step pre-hook), updates the shards, and a step post-hook
  all-gathers every bucket in place over the replica group, so every replica's parameters are
  whole again. ``opt.zero_grad()`` clears the parameters' gradients too.

On the wire that is the all-reduce plus an all-gather of the parameters ((D-1)/D of them, half
the all-reduce's bytes): the layout of torch's ``ZeroRedundancyOptimizer`` under DDP. A
reduce-scatter would save that half, but then no rank would hold the averaged gradient the
user's code reads. Only optimizers whose update of an element reads that element's own gradient
and state are sharded (``ELEMENTWISE``; a class of one's own opts in with
``varuna_fx_elementwise = True``); others are refused. An optimizer built directly over the
parameters while sharding is on is refused at its first step (:func:`guard_direct_optimizers`):
it would hold the whole state on every replica, which the plan may not have room for.

The hooks read the optimizer's record (:class:`Made`), not what they closed over, so an
in-place morph can re-point the same optimizer object at another layout (``zero_repoint.py``,
which also makes it over a runtime's parameters: ``build_optimizer``);
nothing else of a sharding outlives a step, so a morph moves only the shards' state.

Limits: "auto" shards a candidate only when it does not fit unsharded, so a candidate that fits
unsharded on a memory-bound partition is not tried sharded (where a looser cap might balance it
better). Loading a checkpoint into a sharded optimizer reads every chunk of the parameters the
rank holds (the other replicas' too), transiently the stage's whole state.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ...errors import OptimizerError
from ..comm import BUCKET_BYTES, launch, wait
from ..traffic import SENT

# torch optimizers whose step updates every element from that element's gradient and state only
ELEMENTWISE = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop",
    "Rprop", "ASGD") if hasattr(torch.optim, n))
OPT_IN = "varuna_fx_elementwise"
# torch 2.13 renamed the flat collective (the old name warns); older torch has only that
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class Piece:
    """One parameter's place in a bucket's flat buffer."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int


@dataclass
class Bucket:
    group: int  # the user's param group
    pieces: list[Piece]
    flat: torch.Tensor  # padded; the parameters' data view it
    shard_size: int
    shard: nn.Parameter  # this replica's elements of ``flat`` (the same memory)
    lo: int  # where the shard starts in ``flat``


@dataclass
class ZeroLayout:
    """What a sharded optimizer holds: buckets, and full parameters it steps unsharded."""

    replica: int
    replicas: int
    buckets: list[Bucket]
    # (user group, name, parameter): held parameters whose gradients are not synchronised
    # here (never read by forward, frozen), 0-d or empty: stepped whole, as unsharded
    whole: list[tuple[int, str, nn.Parameter]] = field(default_factory=list)

    def group_members(self, group: int) -> list[Any]:
        """The inner optimizer's params of ``group``, in order: shards, then whole ones."""
        return [b.shard for b in self.buckets if b.group == group] + \
            [p for g, _, p in self.whole if g == group]

    def names(self) -> list[str]:
        return [pc.name for b in self.buckets for pc in b.pieces] + [n for _, n, _ in self.whole]


# inner optimizer -> its layout (the checkpoint code and the step hooks look it up)
_LAYOUTS: weakref.WeakKeyDictionary[torch.optim.Optimizer, ZeroLayout] = \
    weakref.WeakKeyDictionary()


def layout_of(optimizer: Any) -> ZeroLayout | None:
    try:
        return _LAYOUTS.get(optimizer)
    except TypeError:
        return None


def set_layout(optimizer: torch.optim.Optimizer, layout: ZeroLayout | None) -> None:
    """``optimizer`` steps ``layout``'s shards now (None: unsharded; an in-place morph)."""
    if layout is None:
        _LAYOUTS.pop(optimizer, None)
    else:
        _LAYOUTS[optimizer] = layout


def check_elementwise(cls: type) -> None:
    if cls in ELEMENTWISE or getattr(cls, OPT_IN, False) is True:
        return
    known = ", ".join(c.__name__ for c in ELEMENTWISE)
    raise OptimizerError(
        f"{cls.__name__} cannot be sharded over data-parallel replicas: sharding (ZeRO-1) "
        "steps each replica's slice of a flat buffer, which is exact only for optimizers whose "
        f"update of an element reads that element's gradient and state alone ({known}). "
        f"If {cls.__name__}'s is, set `{cls.__name__}.{OPT_IN} = True`; otherwise compile with "
        "shard_optimizer=False"
    )


def user_groups(params: Any, named: dict[str, nn.Parameter]) -> list[dict[str, Any]]:
    """``params`` as torch takes it (None: every held parameter) -> groups of held parameters."""
    if params is None:
        params = list(named.values())
    if isinstance(params, torch.Tensor):
        raise OptimizerError("params must be an iterable of parameters or of dicts "
                             "(param groups), not a tensor")
    params = list(params)
    groups = [dict(g) for g in params] if params and isinstance(params[0], dict) \
        else [{"params": params}]
    mine = {id(p): n for n, p in named.items()}
    seen: set[int] = set()
    for g in groups:
        g["params"] = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        for p in g["params"]:
            if id(p) not in mine:
                raise OptimizerError(
                    "pipe.optimizer got a tensor that is not one of this rank's parameters: "
                    "build param groups from pipe.named_parameters()"
                )
            if id(p) in seen:
                raise OptimizerError(f"{mine[id(p)]} appears in two param groups")
            seen.add(id(p))
    return groups


def bucket_items(groups: list[dict[str, Any]], names: dict[int, str], synced: set[str],
                 bucket_bytes: int = BUCKET_BYTES
                 ) -> tuple[list[tuple[int, tuple, list[tuple[str, nn.Parameter]]]],
                            list[tuple[int, str, nn.Parameter]]]:
    """Which parameters share a bucket (user group, dtype, device; ~``bucket_bytes`` each) and
    which are stepped whole: the grouping alone, touching no tensor, so an in-place morph can
    tell the ranges a new shard will need before it exists (:func:`shard_ranges`)."""
    buckets: list[tuple[int, tuple, list[tuple[str, nn.Parameter]]]] = []
    whole: list[tuple[int, str, nn.Parameter]] = []
    for gi, group in enumerate(groups):
        open_: dict[tuple, list[tuple[str, nn.Parameter]]] = {}
        for p in group["params"]:
            name = names[id(p)]
            if name not in synced or p.dim() == 0 or p.numel() == 0:
                whole.append((gi, name, p))
                continue
            key = (p.dtype, p.device)
            items = open_.setdefault(key, [])
            size = sum(q.numel() for _, q in items) * p.element_size()
            if items and size + p.numel() * p.element_size() > bucket_bytes:
                buckets.append((gi, key, items))
                items = open_[key] = []
            items.append((name, p))
        buckets += [(gi, key, items) for key, items in open_.items() if items]
    return buckets, whole


def build_layout(groups: list[dict[str, Any]], names: dict[int, str], synced: set[str],
                 replica: int, replicas: int, bucket_bytes: int = BUCKET_BYTES) -> ZeroLayout:
    """Buckets over ``groups``' parameters. ``synced``: names whose gradients grad_sync
    averages over the replicas (tied ones included)."""
    buckets, whole = bucket_items(groups, names, synced, bucket_bytes)
    return ZeroLayout(replica, replicas,
                      [_bucket(gi, key, items, replica, replicas) for gi, key, items in buckets],
                      whole)


def shard_ranges(groups: list[dict[str, Any]], names: dict[int, str], synced: set[str],
                 replica: int, replicas: int, bucket_bytes: int = BUCKET_BYTES
                 ) -> dict[str, list[tuple[int, int]]]:
    """(first element, count) of each parameter whose optimizer state replica ``replica``'s
    shard holds, as :func:`build_layout` would cut it (whole parameters: all of them)."""
    buckets, whole = bucket_items(groups, names, synced, bucket_bytes)
    ranges: dict[str, list[tuple[int, int]]] = {n: [(0, p.numel())] for _, n, p in whole}
    for _, _, items in buckets:
        size = math.ceil(sum(p.numel() for _, p in items) / replicas)
        lo, hi, offset = replica * size, (replica + 1) * size, 0
        for name, p in items:
            start, end = max(lo, offset), min(hi, offset + p.numel())
            if start < end:
                ranges.setdefault(name, []).append((start - offset, end - start))
            offset += p.numel()
    return ranges


def _bucket(group: int, key: tuple, items: list[tuple[str, nn.Parameter]], replica: int,
            replicas: int) -> Bucket:
    dtype, device = key
    total = sum(p.numel() for _, p in items)
    shard_size = math.ceil(total / replicas)
    flat = torch.zeros(shard_size * replicas, dtype=dtype, device=device)
    pieces, offset = [], 0
    with torch.no_grad():
        for name, p in items:
            view = flat[offset:offset + p.numel()]
            view.copy_(p.data.reshape(-1))
            p.data = view.view_as(p)  # the module computes with the bucket's memory
            pieces.append(Piece(name, p, offset, p.numel()))
            offset += p.numel()
    shard = nn.Parameter(flat[replica * shard_size:(replica + 1) * shard_size])
    return Bucket(group, pieces, flat, shard_size, shard, replica * shard_size)


def shard_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensor state ``optimizer`` holds (this rank's shard when sharded)."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values()
               for v in s.values() if isinstance(v, torch.Tensor))


class ZeroSync:
    """The shards' gradients before each optimizer step, and the parameter all-gather after.

    The gradients are averaged by grad_sync's ordinary all-reduce, so every rank's ``p.grad``
    is the replica-averaged gradient as in eager data parallelism; just before ``opt.step()``
    each bucket's shard takes a copy of its slice of them (:meth:`take_grads`), so whatever the
    user did to ``.grad`` in between (clipping, edits, replacing it) is what the shard steps on.
    NCCL runs ``all_gather_single``; gloo's ran slower than one broadcast per replica from its
    shard (bench/RESULTS.md, "Figures the code cites"), which it uses instead."""

    def __init__(self, layout: ZeroLayout, group: Any, timeout: float, who: str) -> None:
        self.layout, self.group, self.timeout, self.who = layout, group, timeout, who
        self.gloo = dist.get_backend(group) == "gloo"
        self.ranks = dist.get_process_group_ranks(group)  # by group rank = shard index
        # bytes this rank sends in the all-gathers per NCCL's ring algorithm: (D-1) shards
        # each (the gradient all-reduce is grad_sync's, as without sharding)
        self.ring_bytes = 0

    def take_grads(self) -> None:
        """Each shard's ``.grad``: its slice of the parameters' gradients as they are now;
        None for a bucket none of whose parameters has a gradient (skipped, as torch's
        optimizers skip such parameters)."""
        for b in self.layout.buckets:
            missing = [pc.name for pc in b.pieces if pc.param.grad is None]
            if len(missing) == len(b.pieces):
                b.shard.grad = None
                continue
            if missing:  # the same on every replica (grads are): all raise
                have = next(pc.name for pc in b.pieces if pc.param.grad is not None)
                raise OptimizerError(
                    f"{missing[0]}.grad is None at the optimizer step, but {have}.grad, sharded "
                    "in the same flat slices (ZeRO-1), is not: a sharded optimizer cannot skip "
                    "one parameter of a slice as torch's optimizers skip a parameter without a "
                    "gradient. Give it a gradient (zeros, if a zero gradient is what you mean), "
                    "or compile with shard_optimizer=False")
            grad = b.shard.grad
            if grad is None or grad.shape != b.shard.shape or grad.dtype != b.shard.dtype:
                grad = torch.zeros_like(b.shard)
            lo, hi = b.lo, b.lo + b.shard_size
            with torch.no_grad():
                for pc in b.pieces:
                    start, end = max(lo, pc.offset), min(hi, pc.offset + pc.numel)
                    if start < end:
                        src = pc.param.grad.reshape(-1)[start - pc.offset:end - pc.offset]
                        grad[start - lo:end - lo].copy_(src)
            b.shard.grad = grad

    def zero_grads(self, set_to_none: bool) -> None:
        """``opt.zero_grad()``: the parameters' gradients too (pipe.step accumulates into
        them, so zeroing only the shards' would let them pile up)."""
        for b in self.layout.buckets:
            for pc in b.pieces:
                if pc.param.grad is None:
                    continue
                if set_to_none:
                    pc.param.grad = None
                else:  # as torch's Optimizer.zero_grad
                    if pc.param.grad.grad_fn is not None:
                        pc.param.grad.detach_()
                    else:
                        pc.param.grad.requires_grad_(False)
                    pc.param.grad.zero_()

    def gather(self) -> None:
        """After the shards were updated: every replica's parameters whole again."""
        works = []
        d = self.layout.replicas
        for b in self.layout.buckets:
            if self.gloo:
                for k, src in enumerate(self.ranks):
                    part = b.flat[k * b.shard_size:(k + 1) * b.shard_size]
                    works.append(launch(lambda p=part, s=src: dist.broadcast(
                        p, src=s, group=self.group, async_op=True), self.who, self._gathering))
                    SENT.broadcast(part, src)
            else:
                works.append(launch(lambda b=b: _ALL_GATHER(
                    b.flat, b.shard.data, group=self.group, async_op=True), self.who,
                    self._gathering))
                SENT.scatter_or_gather(b.flat, self.group)
            self.ring_bytes += (d - 1) * b.shard_size * b.flat.element_size()
        for w in works:
            wait(w, self.timeout, self.who, self._gathering)

    def _gathering(self) -> str:
        return f"the sharded optimizer's parameter all-gather with ranks {self.ranks}"


@dataclass
class Made:
    """What ``pipe.optimizer`` made, kept so an in-place morph can point the same optimizer
    object at another layout's parameters (``repoint_optimizer``): its hooks read the current
    sharding from here, not from what they closed over."""

    setting: bool | str  # compile's shard_optimizer
    grad_sync: Any  # the runtime's GradSync it steps with (None in one process; grad_sync.py
    # imports this module, so the type is named where runtimes are: runtime/step.py)
    zero: ZeroSync | None  # the sharding now (None: unsharded)
    group_of: dict[str, int]  # canonical fqn -> its param group (the whole model's, once known)
    hooked: bool = False  # the step hooks and zero_grad are installed (they read this record)


# every optimizer pipe.optimizer made, sharded or not (the direct-optimizer guard lets them by)
_MADE: weakref.WeakKeyDictionary[torch.optim.Optimizer, Made] = weakref.WeakKeyDictionary()


def made_by_pipeline(optimizer: Any) -> Made | None:
    try:
        return _MADE.get(optimizer)
    except TypeError:
        return None


def remember_made(optimizer: torch.optim.Optimizer, made: Made) -> Made:
    """Record that ``pipe.optimizer`` made ``optimizer`` (``zero_repoint.build_optimizer``)."""
    _MADE[optimizer] = made
    return made


def _before_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The newest pipe.optimizer's only; its shards take their slices of ``.grad``."""
    made = _MADE.get(opt)
    if made is None or made.zero is None:
        return
    if made.grad_sync.zero is not made.zero:
        raise OptimizerError("this optimizer was replaced by a later pipe.optimizer call: "
                             "step the newest one")
    made.zero.take_grads()


def _gather_after_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    made = _MADE.get(opt)
    if made is not None and made.zero is not None:
        made.zero.gather()


def install_hooks(optimizer: torch.optim.Optimizer, made: Made) -> None:
    """Once per optimizer: the step hooks and a ``zero_grad`` that also clears the parameters'
    gradients while sharded (all read ``made``, so a morph that reshards changes none)."""
    if made.hooked:
        return
    optimizer.register_step_pre_hook(_before_step)
    optimizer.register_step_post_hook(_gather_after_step)
    inner_zero_grad = optimizer.zero_grad

    @functools.wraps(inner_zero_grad)
    def zero_grad(set_to_none: bool = True) -> None:
        if made.zero is not None:
            made.zero.zero_grads(set_to_none)
        inner_zero_grad(set_to_none)

    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
    made.hooked = True


def make_sharded(cls: type, groups: list[dict[str, Any]], layout: ZeroLayout, sync: ZeroSync,
                 defaults: dict[str, Any]) -> torch.optim.Optimizer:
    """The user's optimizer class over this rank's shards (:func:`build_optimizer` installs
    the hooks: stepping first copies the shards' slices of the parameters' gradients, then
    all-gathers; ``zero_grad`` also clears the parameters' gradients)."""
    inner_groups = [{**{k: v for k, v in g.items() if k != "params"},
                     "params": layout.group_members(i)} for i, g in enumerate(groups)]
    optimizer = cls(inner_groups, **defaults)
    _LAYOUTS[optimizer] = layout
    return optimizer


# -- refusing optimizers that bypass the shards ---------------------------------------------------

# id(parameter) -> (its ref, the reason, what a direct optimizer would get wrong, the other way)
_GUARDED: dict[int, tuple[weakref.ref, str, str, str]] = {}
_HOOK: Any = None
_SHARDED = "it would hold the whole optimizer state on every replica instead of 1/D of it"


def guard_direct_optimizers(params: Iterable[nn.Parameter], reason: str,
                            consequence: str = _SHARDED,
                            fix: str = ", or compile with shard_optimizer=False") -> None:
    """Refuse, at their first step, optimizers over ``params`` not made by pipe.optimizer
    (``reason``: why they must be; ``consequence``: what a direct one would get wrong;
    ``fix``: the other way out)."""
    global _HOOK
    for p in params:
        _GUARDED[id(p)] = (weakref.ref(p), reason, consequence, fix)
    if _HOOK is None:
        _HOOK = register_optimizer_step_pre_hook(_refuse_direct)


def _refuse_direct(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _GUARDED or layout_of(optimizer) is not None or made_by_pipeline(optimizer):
        return  # (pipe.optimizer's, sharded or not: an in-place morph to D = 1 unshards it)
    for group in optimizer.param_groups:
        for p in group["params"]:
            found = _GUARDED.get(id(p))
            if found is not None and found[0]() is p:
                raise OptimizerError(
                    f"this {type(optimizer).__name__} was built over the pipeline's parameters "
                    f"directly, but {found[1]}: {found[2]}. Build it with "
                    f"pipe.optimizer(torch.optim.{type(optimizer).__name__}, ...) (same "
                    f"arguments){found[3]}"
                )
