"""ZeRO-1: optimizer state sharded over a stage's D data-parallel replicas.

``pipe.optimizer(cls, params, **defaults)`` with sharding on flattens this rank's trainable
parameters into buckets: per (param group, dtype, kind), ~25 MB each, padded to a multiple of D.
The parameters' ``.data`` become views of the bucket's flat buffer, so replica ``r``'s shard
(elements ``[r*s, (r+1)*s)``) is one ``nn.Parameter`` viewing that same memory; the user's
optimizer class is built over those shards (one list per param group, so groups, their
hyperparameters and LR schedulers stay as the user made them) and updates them in place.

Per step:

* after the stage's last backward, each plain bucket's gradients are copied into a flat buffer
  and ``reduce_scatter_tensor``-ed (asynchronous, bucketed) over the replica group; the shard's
  ``.grad`` is this replica's slice of the average. ``p.grad`` keeps this rank's own
  contribution (so gradient accumulation over several ``pipe.step`` calls works unchanged).
* tied parameters keep today's all-reduce over every holder of every replica (``grad_sync``);
  their buckets take this replica's slice of the already-averaged gradient.
* ``opt.step()`` updates the shards; a step post-hook then ``all_gather_into_tensor``-s every
  bucket in place over the replica group, so every replica's parameters are whole again.

On the wire that is a reduce-scatter plus an all-gather, what NCCL's ring all-reduce is made of:
no more bytes than the all-reduce (gloo implements the reduce-scatter as a full all-reduce, so
there it moves 1.5x; see bench/RESULTS.md). Only optimizers whose update of an element reads that
element's own gradient and state are sharded (``ELEMENTWISE``; a class of one's own opts in with
``varuna_fx_elementwise = True``); others are refused. An optimizer built directly over the
parameters while sharding is on is refused at its first step (:func:`guard_direct_optimizers`):
its parameters would see unaveraged gradients.

Limits: "auto" shards a candidate only when it does not fit unsharded, so a candidate that fits
unsharded on a memory-bound partition is not tried sharded (where a looser cap might balance it
better). Loading a checkpoint into a sharded optimizer reads every chunk of the parameters the
rank holds (the other replicas' too), transiently the stage's whole state. The gradients are
copied into a flat buffer per bucket for the reduction (as the all-reduce's buckets are).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import OptimizerError
from .comm import BUCKET_BYTES, launch, wait
from .traffic import SENT

# torch optimizers whose step updates every element from that element's gradient and state only
ELEMENTWISE = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop",
    "Rprop", "ASGD") if hasattr(torch.optim, n))
OPT_IN = "varuna_fx_elementwise"
# torch 2.13 renamed the flat collectives (the old names warn); older torch has only those
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
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
    tied: bool  # gradient already averaged in place by the tied all-reduce
    counts_in_norm: bool  # False: a tied copy whose lowest holder is another stage
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
                 tied_here: dict[str, bool], bucket_bytes: int = BUCKET_BYTES
                 ) -> tuple[list[tuple[int, tuple, list[tuple[str, nn.Parameter]]]],
                            list[tuple[int, str, nn.Parameter]]]:
    """Which parameters share a bucket (user group, dtype, device, kind; ~``bucket_bytes``
    each) and which are stepped whole: the grouping alone, touching no tensor, so an in-place
    morph can tell the ranges a new shard will need before it exists (:func:`shard_ranges`)."""
    buckets: list[tuple[int, tuple, list[tuple[str, nn.Parameter]]]] = []
    whole: list[tuple[int, str, nn.Parameter]] = []
    for gi, group in enumerate(groups):
        open_: dict[tuple, list[tuple[str, nn.Parameter]]] = {}
        for p in group["params"]:
            name = names[id(p)]
            if name not in synced or p.dim() == 0 or p.numel() == 0:
                whole.append((gi, name, p))
                continue
            kind = ("tied", tied_here[name]) if name in tied_here else ("plain", True)
            key = (p.dtype, p.device, *kind)
            items = open_.setdefault(key, [])
            size = sum(q.numel() for _, q in items) * p.element_size()
            if items and size + p.numel() * p.element_size() > bucket_bytes:
                buckets.append((gi, key, items))
                items = open_[key] = []
            items.append((name, p))
        buckets += [(gi, key, items) for key, items in open_.items() if items]
    return buckets, whole


def build_layout(groups: list[dict[str, Any]], names: dict[int, str], synced: set[str],
                 tied_here: dict[str, bool], replica: int, replicas: int,
                 bucket_bytes: int = BUCKET_BYTES) -> ZeroLayout:
    """Buckets over ``groups``' parameters. ``synced``: names whose gradients grad_sync
    reduces; ``tied_here``: tied name -> whether this stage is its lowest holder."""
    buckets, whole = bucket_items(groups, names, synced, tied_here, bucket_bytes)
    return ZeroLayout(replica, replicas,
                      [_bucket(gi, key, items, replica, replicas) for gi, key, items in buckets],
                      whole)


def shard_ranges(groups: list[dict[str, Any]], names: dict[int, str], synced: set[str],
                 tied_here: dict[str, bool], replica: int, replicas: int,
                 bucket_bytes: int = BUCKET_BYTES) -> dict[str, list[tuple[int, int]]]:
    """(first element, count) of each parameter whose optimizer state replica ``replica``'s
    shard holds, as :func:`build_layout` would cut it (whole parameters: all of them)."""
    buckets, whole = bucket_items(groups, names, synced, tied_here, bucket_bytes)
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
    dtype, device, kind, counts = key
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
    return Bucket(group, kind == "tied", counts, pieces, flat, shard_size, shard,
                  replica * shard_size)


def shard_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensor state ``optimizer`` holds (this rank's shard when sharded)."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values()
               for v in s.values() if isinstance(v, torch.Tensor))


class ZeroSync:
    """The sharded half of gradient synchronisation and the parameter all-gather.

    NCCL runs ``reduce_scatter_single`` and ``all_gather_single`` (its ring: (D-1)/D of the
    buffer each, as the two halves of its all-reduce). gloo has both, but sends the whole
    buffer for a reduce-scatter and runs both several times slower than its ring all-reduce
    (bench/RESULTS.md, "Sharded optimizer state (ZeRO-1)" and "Figures the code cites"), so on
    gloo the reduce-scatter is its all-reduce (of a copy; this replica keeps its slice) and the
    all-gather one broadcast per replica from its shard, (D-1) shards per rank."""

    def __init__(self, layout: ZeroLayout, group: Any, timeout: float, who: str) -> None:
        self.layout, self.group, self.timeout, self.who = layout, group, timeout, who
        self.gloo = dist.get_backend(group) == "gloo"
        self.ranks = dist.get_process_group_ranks(group)  # by group rank = shard index
        # bytes this rank sends per NCCL's ring algorithm: (D-1)/D of each reduce-scattered
        # buffer and (D-1) shards per all-gather (gloo's all-reduce sends twice the first)
        self.ring_bytes = 0

    def start(self) -> ZeroReduce:
        return ZeroReduce(self)

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

    def shards(self) -> list[nn.Parameter]:
        return [b.shard for b in self.layout.buckets]

    def norm_shards(self) -> list[nn.Parameter]:
        return [b.shard for b in self.layout.buckets if b.counts_in_norm]


class ZeroReduce:
    """The reduce-scatters of one step in flight; :meth:`finish` sets the shards' grads.
    Launched after the tied all-reduces and finished after them (grad_sync's order), so a
    tied bucket reads averaged gradients."""

    def __init__(self, sync: ZeroSync) -> None:
        self.sync = sync
        self.pending: list[tuple[Bucket, Any, torch.Tensor]] = []
        d = sync.layout.replicas
        for b in sync.layout.buckets:
            if b.tied:
                continue
            flat = _flat_grads(b)
            if sync.gloo:  # (see ZeroSync) the whole buffer, in place
                out = flat
                work = launch(lambda f=flat: dist.all_reduce(f, group=sync.group,
                                                             async_op=True),
                              sync.who, self._what)
                SENT.all_reduce(flat, sync.group)
            else:
                out = torch.empty(b.shard_size, dtype=flat.dtype, device=flat.device)
                work = launch(lambda f=flat, o=out: _REDUCE_SCATTER(
                    o, f, group=sync.group, async_op=True), sync.who, self._what)
                SENT.scatter_or_gather(flat, sync.group)
            sync.ring_bytes += flat.numel() * flat.element_size() * (d - 1) // d
            self.pending.append((b, work, out))

    def _what(self) -> str:
        return f"the sharded gradient reduce-scatter with ranks {self.sync.ranks}"

    def finish(self) -> None:
        sync = self.sync
        d = sync.layout.replicas
        for b, work, out in self.pending:
            wait(work, sync.timeout, sync.who, self._what)
            if out.numel() != b.shard_size:  # gloo's all-reduce: this replica's slice
                out = out[b.lo:b.lo + b.shard_size].clone()
            b.shard.grad = out.div_(d)
        self.pending.clear()
        for b in sync.layout.buckets:
            if b.tied:  # averaged in place already: this replica's slice
                lo = b.lo
                b.shard.grad = _flat_grads(b)[lo:lo + b.shard_size].clone()


def _flat_grads(b: Bucket) -> torch.Tensor:
    flat = torch.zeros_like(b.flat)
    for pc in b.pieces:
        if pc.param.grad is not None:
            flat[pc.offset:pc.offset + pc.numel].copy_(pc.param.grad.reshape(-1))
    return flat


@dataclass
class Made:
    """What ``pipe.optimizer`` made, kept so an in-place morph can point the same optimizer
    object at another layout's parameters (``repoint_optimizer``): its hooks read the current
    sharding from here, not from what they closed over."""

    setting: bool | str  # compile's shard_optimizer
    grad_sync: Any  # the runtime's GradSync it steps with (None in one process)
    zero: ZeroSync | None  # the sharding now (None: unsharded)
    group_of: dict[str, int]  # canonical fqn -> its param group (the whole model's, once known)
    hooked: bool = False  # the step hooks are registered (they read this record)


_MADE: weakref.WeakKeyDictionary[torch.optim.Optimizer, Made] = weakref.WeakKeyDictionary()


def made_by_pipeline(optimizer: Any) -> Made | None:
    try:
        return _MADE.get(optimizer)
    except TypeError:
        return None


def _gather_after_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    made = _MADE.get(opt)
    if made is not None and made.zero is not None:
        made.zero.gather()


def _current(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    made = _MADE.get(opt)
    if made is not None and made.zero is not None and made.grad_sync.zero is not made.zero:
        raise OptimizerError("this optimizer was replaced by a later pipe.optimizer call: "
                             "step the newest one")


def make_sharded(cls: type, groups: list[dict[str, Any]], layout: ZeroLayout, sync: ZeroSync,
                 defaults: dict[str, Any]) -> torch.optim.Optimizer:
    """The user's optimizer class over this rank's shards; stepping it all-gathers."""
    inner_groups = [{**{k: v for k, v in g.items() if k != "params"},
                     "params": layout.group_members(i)} for i, g in enumerate(groups)]
    optimizer = cls(inner_groups, **defaults)
    _LAYOUTS[optimizer] = layout
    return optimizer


def sharded(runtime: Any, setting: bool | str) -> bool:
    """Whether ``pipe.optimizer`` shards over ``runtime``'s replicas with compile's
    ``shard_optimizer`` ``setting``: a distributed run with D > 1, unless told never to."""
    sync = getattr(runtime, "grad_sync", None)
    return sync is not None and runtime.plan.data_parallel > 1 and setting is not False \
        and sync.groups.data_parallel is not None


def _shard_layout(runtime: Any, groups: list[dict[str, Any]],
                  names: dict[int, str]) -> tuple[ZeroLayout, ZeroSync]:
    sync = runtime.grad_sync
    tied = {n for names_, _ in sync.groups.tied for n in names_}
    local = set(runtime.local_stages)  # (virtual stages: several)
    lowest = {n for n in tied if min(runtime.plan.tied_parameters[n]) in local}
    group = sync.groups.data_parallel
    layout = build_layout(groups, names, set(sync.held), {n: n in lowest for n in tied},
                          dist.get_rank(group=group), runtime.plan.data_parallel)
    return layout, ZeroSync(layout, group, runtime.timeout, sync.who)


def build_optimizer(runtime: Any, named: dict[str, nn.Parameter], cls: type, params: Any,
                    defaults: dict[str, Any], setting: bool | str) -> torch.optim.Optimizer:
    """``pipe.optimizer``: ``cls`` over this rank's shards when sharding is on and D > 1 (a
    distributed run), else over the parameters themselves."""
    if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer):
        raise OptimizerError(f"pipe.optimizer takes a torch.optim.Optimizer class (e.g. "
                             f"torch.optim.AdamW), not {cls!r}")
    groups = user_groups(params, named)
    names = {id(p): n for n, p in named.items()}
    group_of = {names[id(p)]: gi for gi, g in enumerate(groups) for p in g["params"]}
    sync = getattr(runtime, "grad_sync", None)
    if not sharded(runtime, setting):
        optimizer = cls(groups, **defaults)
        _MADE[optimizer] = Made(setting, sync, None, group_of)
        return optimizer
    check_elementwise(cls)
    layout, zero = _shard_layout(runtime, groups, names)
    optimizer = make_sharded(cls, groups, layout, zero, defaults)
    _MADE[optimizer] = Made(setting, sync, zero, group_of, hooked=True)
    optimizer.register_step_pre_hook(_current)
    optimizer.register_step_post_hook(_gather_after_step)
    sync.shard(zero, runtime.replica_index)
    guard_direct_optimizers(named.values(), "pipe.optimizer shards their optimizer state "
                            "over the replicas (shard_optimizer)")
    return optimizer


def repoint_optimizer(optimizer: torch.optim.Optimizer, runtime: Any,
                      named: dict[str, nn.Parameter]) -> None:
    """Point an optimizer ``pipe.optimizer`` made at ``runtime``'s parameters (an in-place morph:
    the same object, so LR schedulers holding it carry on): each param group gets the held
    parameters that belonged to it (``Made.group_of``), sharded over the new D when the rule of
    :func:`build_optimizer` says so. The state is emptied: the morph loads what moved."""
    made = _MADE[optimizer]
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []}
              for g in optimizer.param_groups]
    for name, p in named.items():
        if name in made.group_of:
            groups[made.group_of[name]]["params"].append(p)
    names = {id(p): n for n, p in named.items()}
    made.grad_sync = getattr(runtime, "grad_sync", None)
    if sharded(runtime, made.setting):
        check_elementwise(type(optimizer))
        layout, zero = _shard_layout(runtime, groups, names)
        for gi, group in enumerate(optimizer.param_groups):
            group["params"] = layout.group_members(gi)
        _LAYOUTS[optimizer] = layout
        if not made.hooked:  # hooks once: they read ``made`` at every step
            optimizer.register_step_pre_hook(_current)
            optimizer.register_step_post_hook(_gather_after_step)
            made.hooked = True
        made.zero = zero
        made.grad_sync.shard(zero, runtime.replica_index)
        guard_direct_optimizers(named.values(), "pipe.optimizer shards their optimizer state "
                                "over the replicas (shard_optimizer)")
    else:
        for group, mine in zip(optimizer.param_groups, groups):
            group["params"] = mine["params"]
        _LAYOUTS.pop(optimizer, None)
        made.zero = None
    optimizer.state.clear()


# -- refusing optimizers that bypass the shards ---------------------------------------------------

# id(parameter) -> (its ref, the reason, (what would go wrong, the other way out))
_GUARDED: dict[int, tuple[weakref.ref, str, tuple[str, str]]] = {}
_HOOK: Any = None


_AVERAGED = ("its step would apply gradients that are not averaged over the data-parallel "
             "replicas", "compile with shard_optimizer=False")


def guard_direct_optimizers(params: Iterable[nn.Parameter], reason: str,
                            why: tuple[str, str] = _AVERAGED) -> None:
    """Refuse, at their first step, optimizers over ``params`` not made by pipe.optimizer.
    ``why``: what would go wrong, and the other way out (besides ``pipe.optimizer``)."""
    global _HOOK
    for p in params:
        _GUARDED[id(p)] = (weakref.ref(p), reason, why)
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
                    f"directly, but {found[1]}: {found[2][0]}. Build it with "
                    f"pipe.optimizer(torch.optim.{type(optimizer).__name__}, ...) (same "
                    f"arguments), or {found[2][1]}"
                )
