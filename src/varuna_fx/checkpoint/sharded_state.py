"""Sharded (ZeRO-1) optimizer state in checkpoints, per FQN, so it loads under any layout.

A sharded optimizer (``runtime/sync/zero.py``) holds, per bucket, one flat shard of its state: a
contiguous range of the bucket, cutting through parameters. Saving splits it back into
parameters: a parameter's elementwise state (shaped like the shard: ``exp_avg``, ...) is written
as the flat chunk this rank holds, ``optim_shard/<fqn>/<key>/<start>`` (elements
``[start, start + n)`` of the parameter flattened); the replicas' chunks of a parameter tile it.
Its other state (0-d: ``step``) and its group id are the same on every replica and written as
the unsharded format writes them (``optimizer_state.py``; DCP keeps one copy).

Loading takes either form for either optimizer: a sharded optimizer cuts its ranges out of whole
tensors or chunks (saved under any D), an unsharded one gets chunks joined into whole tensors.
So a checkpoint moves between any (P, D, sharding on or off). Every chunk of a parameter this
rank holds is read (the other replicas' too): at most the stage's state, transiently.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CheckpointError
from ..runtime.sync.zero import Bucket, ZeroLayout

CHUNK_PREFIX = "optim_shard/"


def chunk_key(fqn: str, key: str, start: int) -> str:
    return f"{CHUNK_PREFIX}{fqn}/{key}/{start}"


def overlaps(b: Bucket) -> list[tuple[str, int, int, int]]:
    """(fqn, first element in the parameter, first in the shard, count) of every parameter
    this rank's shard of ``b`` covers."""
    found = []
    lo, hi = b.lo, b.lo + b.shard_size
    for pc in b.pieces:
        start, end = max(lo, pc.offset), min(hi, pc.offset + pc.numel)
        if start < end:
            found.append((pc.name, start - pc.offset, start - lo, end - start))
    return found


def sharded_entries(optimizer: torch.optim.Optimizer, layout: ZeroLayout, group_id: Any,
                    encode: Any, prefixes: dict[str, str]) -> dict[str, torch.Tensor]:
    """DCP entries of a sharded optimizer (``prefixes``: optimizer_state's key prefixes)."""
    state = optimizer.state_dict()
    entries: dict[str, torch.Tensor] = {}
    for gi, group in enumerate(state["param_groups"]):
        hyper = {k: v for k, v in group.items() if k != "params"}
        gid = group_id(hyper)
        entries[f"{prefixes['group_object']}{gid}"] = encode(hyper)
        members = _members(layout, gi)
        for index, (bucket, name) in zip(group["params"], members):
            saved = state["state"].get(index, {})
            parts = overlaps(bucket) if bucket is not None else [(name, 0, 0, -1)]
            for fqn, at, shard_at, count in parts:
                entries[f"{prefixes['group']}{fqn}"] = torch.tensor([gid], dtype=torch.int64)
                other = {}
                for key, value in saved.items():
                    if not isinstance(value, torch.Tensor):
                        other[key] = value
                    elif bucket is not None and _elementwise(value, bucket):
                        entries[chunk_key(fqn, key, at)] = \
                            value.detach()[shard_at:shard_at + count]
                    else:
                        entries[f"{prefixes['tensor']}{fqn}/{key}"] = value.detach()
                if other:
                    entries[f"{prefixes['object']}{fqn}"] = encode(other)
    return entries


def _members(layout: ZeroLayout, group: int) -> list[tuple[Bucket | None, str]]:
    """The inner optimizer's params of ``group`` in order: (bucket, "") per shard, then
    (None, fqn) per parameter held whole."""
    return [(b, "") for b in layout.buckets if b.group == group] + \
        [(None, n) for g, n, _ in layout.whole if g == group]


def _elementwise(value: torch.Tensor, bucket: Bucket) -> bool:
    return value.dim() == 1 and value.numel() == bucket.shard_size


class SavedState:
    """The loaded optimizer entries, per FQN: whole tensors, chunks and other state."""

    def __init__(self, loaded: dict[str, torch.Tensor], tensor_prefix: str,
                 object_prefix: str, decode: Any) -> None:
        self.whole: dict[str, dict[str, torch.Tensor]] = {}
        self.chunks: dict[str, dict[str, list[tuple[int, torch.Tensor]]]] = {}
        self.objects: dict[str, dict[str, Any]] = {}
        for key, value in loaded.items():
            if key.startswith(tensor_prefix):
                fqn, name = key[len(tensor_prefix):].rsplit("/", 1)
                self.whole.setdefault(fqn, {})[name] = value
            elif key.startswith(CHUNK_PREFIX):
                fqn, name, start = key[len(CHUNK_PREFIX):].rsplit("/", 2)
                self.chunks.setdefault(fqn, {}).setdefault(name, []).append((int(start), value))
            elif key.startswith(object_prefix):
                self.objects.setdefault(key[len(object_prefix):], {}).update(decode(value))

    def elementwise_keys(self, fqn: str, shape: torch.Size) -> list[str]:
        keys = list(self.chunks.get(fqn, {}))
        keys += [k for k, v in self.whole.get(fqn, {}).items()
                 if tuple(v.shape) == tuple(shape) and len(shape) > 0 and k not in keys]
        return keys

    def other(self, fqn: str, shape: torch.Size) -> dict[str, Any]:
        """State that is not per element (``step``), and non-tensor state."""
        every = set(self.elementwise_keys(fqn, shape))
        found: dict[str, Any] = {k: v for k, v in self.whole.get(fqn, {}).items()
                                 if k not in every}
        found.update(self.objects.get(fqn, {}))
        return found

    def elements(self, fqn: str, key: str, shape: torch.Size, start: int,
                 count: int) -> torch.Tensor:
        """Elements ``[start, start + count)`` of ``fqn``'s flattened ``key`` state."""
        whole = self.whole.get(fqn, {}).get(key)
        if whole is not None and tuple(whole.shape) == tuple(shape):
            return whole.reshape(-1)[start:start + count]
        pieces = sorted(self.chunks.get(fqn, {}).get(key, []), key=lambda c: c[0])
        if not pieces:
            raise CheckpointError(f"the checkpoint has no {key!r} state for {fqn}")
        out = torch.empty(count, dtype=pieces[0][1].dtype)
        covered = 0
        for at, chunk in pieces:
            lo, hi = max(at, start), min(at + chunk.numel(), start + count)
            if lo < hi:
                out[lo - start:hi - start] = chunk[lo - at:hi - at]
                covered += hi - lo
        if covered != count:
            raise CheckpointError(
                f"the checkpoint's {key!r} chunks of {fqn} cover {covered} of the {count} "
                "elements needed: it is incomplete (saved by fewer ranks than it names)"
            )
        return out

    def whole_state(self, fqn: str, shape: torch.Size) -> dict[str, Any]:
        """``fqn``'s state as an unsharded optimizer holds it (chunks joined)."""
        state = self.other(fqn, shape)
        numel = int(torch.Size(shape).numel())
        for key in self.elementwise_keys(fqn, shape):
            state[key] = self.elements(fqn, key, shape, 0, numel).reshape(shape)
        return state


def restore_sharded(optimizer: torch.optim.Optimizer, layout: ZeroLayout, saved: SavedState,
                    group_hyper: Any) -> None:
    """Load ``saved`` (any layout's) into a sharded optimizer. ``group_hyper(fqns, group)``:
    the saved hyperparameters of the group those parameters form now."""
    shapes = {pc.name: pc.param.shape for b in layout.buckets for pc in b.pieces}
    shapes.update({n: p.shape for _, n, p in layout.whole})
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for gi, group in enumerate(optimizer.param_groups):
        members = _members(layout, gi)
        fqns = [pc.name for b, _ in members if b is not None for pc in b.pieces] + \
            [n for b, n in members if b is None]
        indices = list(range(index, index + len(members)))
        index += len(members)
        groups.append({**group_hyper(fqns, group), "params": indices})
        for i, (bucket, name) in zip(indices, members):
            one = _shard_state(bucket, saved, shapes) if bucket is not None else \
                saved.whole_state(name, shapes[name])
            if one:
                state[i] = one
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _shard_state(bucket: Bucket, saved: SavedState, shapes: dict[str, torch.Size]
                 ) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for fqn, at, shard_at, count in overlaps(bucket):
        shape = shapes[fqn]
        for key in saved.elementwise_keys(fqn, shape):
            values = saved.elements(fqn, key, shape, at, count)
            if key not in state:  # padding (and parameters without state) start at zero
                state[key] = torch.zeros(bucket.shard_size, dtype=values.dtype)
            state[key][shard_at:shard_at + count] = values
        for key, value in saved.other(fqn, shape).items():
            state.setdefault(key, value)
    return state
