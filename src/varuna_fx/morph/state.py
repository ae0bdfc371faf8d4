"""What a rank holds and what it needs, as flat ranges per item (``morph/transfer.py``).

Items, each seen as its flattened elements:

* ``(fqn, "")``: a parameter or persistent buffer of the model, under its canonical FQN (every
  holder holds all of it);
* ``(fqn, "o:<key>")``: one entry of that parameter's optimizer state, as the FQN-keyed
  checkpoint format names it (``checkpoint/optimizer_state.py``): a ZeRO-1 shard holds chunks of
  the elementwise entries (``exp_avg``: the elements its shard covers), every holder holds the
  rest whole (``step``; ``o:@obj`` is non-tensor state, encoded);
* ``("@in", "<k>")``: the k-th tensor of this step's inputs and target, whose elements are
  ``samples x row``: replica r of D holds rows ``[r G/D, (r+1) G/D)`` of the global batch.

A rank's *descriptor* (JSON in the membership store) lists its items with dtype, shape and
whether they are elementwise, the ranges it holds, and the ranges it needs in the new layout.
Optimizer needs are given per parameter (the elements its new shard covers, or all) and
widened to every state entry the holders have (:func:`expand_needs`), so a joiner can say what
it needs before any optimizer exists here. What arrives becomes checkpoint-format entries again
(:func:`optimizer_entries_from`), loaded by the checkpoint code's ``restore_optimizer``: the
same loader a restart uses, so every (P, D, sharding) pair converts the way checkpoints do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.optimizer_state import (
    GROUP_OBJECT_PREFIX,
    GROUP_PREFIX,
    OBJECT_PREFIX,
    TENSOR_PREFIX,
    encode,
    optimizer_entries,
)
from ..checkpoint.sharded_state import CHUNK_PREFIX, chunk_key
from ..init.skip import loaded
from ..runtime.sync.zero import layout_of, shard_ranges
from ..runtime.sync.zero_repoint import sharded
from ..world import safe_json
from .carried import Carried
from .morphable import Morphable
from .transfer import Item, Range, assemble

OPT = "o:"
OBJ = "o:@obj"
INPUT = "@in"


@dataclass
class Info:
    dtype: torch.dtype
    shape: tuple[int, ...]
    elementwise: bool  # ranges of it are meaningful (else it moves whole)

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


@dataclass
class Descriptor:
    """One rank's holdings and needs (what it writes to the store)."""

    holds: dict[Item, list[Range]] = field(default_factory=dict)
    info: dict[Item, Info] = field(default_factory=dict)
    needs_model: dict[str, int] = field(default_factory=dict)  # fqn -> its element count
    needs_optimizer: dict[str, list[Range]] = field(default_factory=dict)
    needs_input: dict[str, list[Range]] = field(default_factory=dict)  # by "@in" key
    signal_at: float | None = None
    # this rank's optimizer state is a ZeRO-1 shard (its only copy): losing it loses state
    sharded: bool = False

    def to_bytes(self) -> bytes:
        def item(i: Item) -> str:
            return f"{i[0]}|{i[1]}"
        return json.dumps({
            "holds": {item(i): r for i, r in self.holds.items()},
            "info": {item(i): [str(v.dtype).removeprefix("torch."), list(v.shape),
                               v.elementwise] for i, v in self.info.items()},
            "needs_model": self.needs_model, "needs_optimizer": self.needs_optimizer,
            "needs_input": self.needs_input, "signal_at": self.signal_at,
            "sharded": self.sharded,
        }).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Descriptor:
        raw = safe_json.loads(data)

        def item(text: str) -> Item:
            fqn, _, key = text.rpartition("|")
            return fqn, key

        def dtype(name: str) -> torch.dtype:
            found = getattr(torch, name, None)
            if not isinstance(found, torch.dtype):
                raise ValueError(f"not a dtype: {name!r}")
            return found

        return cls(
            holds={item(k): [tuple(r) for r in v] for k, v in raw["holds"].items()},
            info={item(k): Info(dtype(v[0]), tuple(v[1]), bool(v[2]))
                  for k, v in raw["info"].items()},
            needs_model={k: int(v) for k, v in raw["needs_model"].items()},
            needs_optimizer={k: [tuple(r) for r in v] for k, v in raw["needs_optimizer"].items()},
            needs_input={k: [tuple(r) for r in v] for k, v in raw["needs_input"].items()},
            signal_at=raw["signal_at"], sharded=bool(raw["sharded"]))


Sources = dict[Item, list[tuple[int, torch.Tensor]]]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1)


def model_holdings(state: dict[str, torch.Tensor], desc: Descriptor, sources: Sources) -> None:
    """Every parameter and persistent buffer this rank holds (``pipe.state_dict()``)."""
    for name, t in state.items():
        item = (name, "")
        desc.holds[item] = [(0, t.numel())]
        desc.info[item] = Info(t.dtype, tuple(t.shape), True)
        sources[item] = [(0, _flat(t))]


def optimizer_holdings(optimizer: torch.optim.Optimizer, names: dict[int, str],
                       shapes: dict[str, tuple[int, ...]], desc: Descriptor,
                       sources: Sources) -> None:
    """The optimizer's state entries (views of its tensors: read them before it changes)."""
    desc.sharded = layout_of(optimizer) is not None and bool(optimizer.state)
    for key, value in optimizer_entries(optimizer, names).items():
        if key.startswith(CHUNK_PREFIX):
            fqn, entry, start = key[len(CHUNK_PREFIX):].rsplit("/", 2)
            item = (fqn, OPT + entry)
            desc.holds.setdefault(item, []).append((int(start), value.numel()))
            desc.info[item] = Info(value.dtype, shapes[fqn], True)
            sources.setdefault(item, []).append((int(start), _flat(value)))
        elif key.startswith(TENSOR_PREFIX):
            fqn, entry = key[len(TENSOR_PREFIX):].rsplit("/", 1)
            item = (fqn, OPT + entry)
            elementwise = tuple(value.shape) == shapes[fqn] and value.dim() > 0
            desc.holds[item] = [(0, value.numel())]
            desc.info[item] = Info(value.dtype, tuple(value.shape), elementwise)
            sources[item] = [(0, _flat(value))]
        elif key.startswith(OBJECT_PREFIX):
            item = (key[len(OBJECT_PREFIX):], OBJ)
            desc.holds[item] = [(0, value.numel())]
            desc.info[item] = Info(value.dtype, tuple(value.shape), False)
            sources[item] = [(0, value)]
        # group ids and hyperparameters travel in the recipe (carried.py), not here


def input_holdings(tensors: list[torch.Tensor], replica: int, replicas: int,
                   desc: Descriptor, sources: Sources) -> None:
    """This replica's rows of the step's inputs (and target): rows ``[r n, (r+1) n)`` of the
    global batch, ``n`` the rows given here."""
    for k, t in enumerate(tensors):
        item = (INPUT, str(k))
        rows = t.shape[0]
        row = t[0].numel() if rows else 0
        desc.holds[item] = [(replica * rows * row, rows * row)]
        desc.info[item] = Info(t.dtype, (rows * replicas, *t.shape[1:]), True)
        sources[item] = [(replica * rows * row, _flat(t))]


def expand_needs(desc: Descriptor, every: list[Descriptor]) -> dict[Item, list[Range]]:
    """``desc``'s needs per item, optimizer needs widened to the entries the holders have."""
    info = merged_info(every)
    needs: dict[Item, list[Range]] = {}
    for name, numel in desc.needs_model.items():  # (known to all: missing if nobody has it)
        needs[(name, "")] = [(0, numel)]
    by_fqn: dict[str, list[Item]] = {}
    for item in info:
        if item[1].startswith(OPT):
            by_fqn.setdefault(item[0], []).append(item)
    for fqn, ranges in desc.needs_optimizer.items():
        for item in by_fqn.get(fqn, []):
            needs[item] = list(ranges) if info[item].elementwise else [(0, info[item].numel)]
    for key, ranges in desc.needs_input.items():
        needs[(INPUT, key)] = list(ranges)
    return needs


def copy_model(state: dict[str, torch.Tensor], got: Sources) -> None:
    """What arrived for the model's tensors, into them (``vf.skip_init`` marks cleared)."""
    with torch.no_grad():
        for name, t in state.items():
            flat = t.data.view(-1)
            for start, values in got.get((name, ""), []):
                flat[start:start + values.numel()].copy_(values)
    loaded(state.values())


def merged_info(every: list[Descriptor]) -> dict[Item, Info]:
    info: dict[Item, Info] = {}
    for d in every:
        info.update(d.info)
    return info


def optimizer_entries_from(pieces: Sources, info: dict[Item, Info], group_of: dict[str, int],
                           hypers: list[dict[str, Any]], fqns: list[str]
                           ) -> dict[str, torch.Tensor]:
    """Checkpoint-format entries (``checkpoint/optimizer_state.py``) of the optimizer state in
    ``pieces`` for the parameters ``fqns``, grouped as ``group_of`` says, the groups'
    hyperparameters ``hypers`` (ids are the group numbers)."""
    entries: dict[str, torch.Tensor] = {}
    for gi, hyper in enumerate(hypers):
        entries[f"{GROUP_OBJECT_PREFIX}{gi}"] = encode(hyper)
    for fqn in fqns:
        entries[f"{GROUP_PREFIX}{fqn}"] = torch.tensor([group_of[fqn]], dtype=torch.int64)
    for (fqn, key), got in pieces.items():
        if not key.startswith(OPT) or fqn not in group_of:
            continue
        entry, meta = key[len(OPT):], info[(fqn, key)]
        if key == OBJ:
            entries[f"{OBJECT_PREFIX}{fqn}"] = assemble(got, 0, meta.numel, meta.dtype)
        elif meta.elementwise:
            for start, flat in got:
                entries[chunk_key(fqn, entry, start)] = flat
        else:  # a copy: a sharded optimizer's ``step`` is one tensor for a whole bucket, and
            # the parameters sharing it would each count every step
            entries[f"{TENSOR_PREFIX}{fqn}/{entry}"] = \
                assemble(got, 0, meta.numel, meta.dtype).view(meta.shape).clone()
    return entries


def optimizer_ranges(optimizer: torch.optim.Optimizer,
                     named: dict[str, torch.nn.Parameter]) -> dict[str, list[tuple[int, int]]]:
    """Per parameter in ``optimizer``, the elements of its state this rank keeps."""
    layout = layout_of(optimizer)
    ids = {id(p): n for n, p in named.items()}
    if layout is None:
        return {ids[id(p)]: [(0, p.numel())] for g in optimizer.param_groups
                for p in g["params"]}
    ranges: dict[str, list[tuple[int, int]]] = {n: [(0, p.numel())] for _, n, p in layout.whole}
    for b in layout.buckets:
        lo, hi = b.lo, b.lo + b.shard_size
        for pc in b.pieces:
            start, end = max(lo, pc.offset), min(hi, pc.offset + pc.numel)
            if start < end:
                ranges.setdefault(pc.name, []).append((start - pc.offset, end - start))
    return ranges


def joiner_ranges(pipe: Morphable, carried: Carried) -> dict[str, list[tuple[int, int]]]:
    """The ranges a joiner's optimizer will keep once its script makes it (as
    ``repoint_optimizer`` would cut them)."""
    assert carried.optimizer is not None
    group_of = carried.optimizer["group_of"]
    named = {n: p for n, p in pipe.named_parameters() if n in group_of}
    groups: list[dict[str, Any]] = [{"params": []} for _ in carried.optimizer["hypers"]]
    for n, p in named.items():
        groups[group_of[n]]["params"].append(p)
    runtime = pipe.runtime
    if not sharded(runtime, carried.optimizer["setting"]):
        return {n: [(0, p.numel())] for n, p in named.items()}
    sync = runtime.grad_sync
    assert sync is not None  # (sharded: a distributed run)
    return shard_ranges(groups, {id(p): n for n, p in named.items()}, set(sync.held),
                        dist.get_rank(group=sync.groups.data_parallel),
                        runtime.plan.data_parallel)
