"""Replay what ``deferred_init`` recorded (``record.py``) on real storage, on one device.

A storage is evaluated by running its creating operation with its recorded arguments (device
arguments pointing at the target device instead of meta), then each in-place step in order,
every tensor argument evaluated the same way (memoised for one :class:`Replayer`). Random
operations draw from a ``torch.Generator`` seeded by :func:`stream_seed` (``seed``, the
storage's name): the canonical FQN of the model tensor it backs, or for a temporary (the
normal draw ``orthogonal_`` factorises) the name of a tensor that consumes it. A seed from
sha256, not Python's ``hash``, so every process and every layout draws the same numbers for
the same tensor, whichever others it materialises.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from ..errors import UninitializedError
from .record import Const, Recording, Ref, Step, StorageRecord, View, flatten_again


def stream_seed(seed: int, name: str) -> int:
    """The generator seed of one tensor: stable across processes and Python runs."""
    digest = hashlib.sha256(f"varuna_fx/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def storage_names(recording: Recording, model_names: dict[int, str]) -> dict[int, str]:
    """A name per recorded storage: the model's own (canonical FQNs), and for a temporary
    the name of a storage that reads it (found from the last reader back), plus its place."""
    names = dict(model_names)
    readers: list[tuple[int, Step]] = [(k, s) for k, r in recording.records.items()
                                       for s in r.steps]
    readers.sort(key=lambda ks: ks[1].ident)
    for key, step in reversed(readers):
        if key not in names:
            continue
        for pos, v in enumerate(step.flat):
            if isinstance(v, Ref) and v.storage not in names:
                names[v.storage] = f"{names[key]}<-{step.ident - _first(recording)}.{pos}"
    return names


def _first(recording: Recording) -> int:
    """Step numbers relative to the block's first (so names do not depend on earlier builds)."""
    return min((s.ident for r in recording.records.values() for s in r.steps), default=0)


_EMPTY = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
          "aten::new_empty_strided"}


def never_written(rec: StorageRecord) -> bool:
    """Allocated uninitialised (``torch.empty``) and never written while the model was built."""
    return (rec.created and len(rec.steps) == 1 and not rec.skipped
            and rec.steps[0].func._schema.name in _EMPTY)


# in-place writes that set every element without reading the old values
_OVERWRITES = {"aten::normal_", "aten::uniform_", "aten::fill_", "aten::zero_", "aten::copy_",
               "aten::random_", "aten::bernoulli_", "aten::exponential_", "aten::cauchy_",
               "aten::log_normal_", "aten::geometric_"}


def _last_overwrite(rec: StorageRecord, version: int) -> int:
    """The first step to replay: the last one before ``version`` that rewrites the whole
    storage without reading it (a model that draws ``reset_parameters``' kaiming numbers and
    then its own normal ones pays for one draw, not two); 1 if there is none."""
    for i in range(version - 1, 0, -1):
        step = rec.steps[i]
        name = step.func.__name__ if step.python else step.func._schema.name
        target = step.flat[0] if step.flat else None
        if (name in _OVERWRITES or step.python) and isinstance(target, Ref) \
                and target.storage == rec.key and _covers(target.view, rec.nbytes) \
                and not any(isinstance(v, Ref) and v.storage == rec.key for v in step.flat[1:]):
            return i
    return 1


def _covers(view: View, nbytes: int) -> bool:
    """Whether a view is every byte of its storage, densely."""
    numel = 1
    for n in view.size:
        numel *= n
    dense, expected = True, 1
    for size, stride in sorted(zip(view.size, view.stride), key=lambda x: x[1]):
        if size > 1 and stride != expected:
            dense = False
        expected *= size
    itemsize = torch.empty(0, dtype=view.dtype).element_size()
    return dense and view.offset == 0 and numel * itemsize == nbytes


def _with_generator(func: Any, kwargs: dict, gen: torch.Generator) -> tuple[Any, dict]:
    if not hasattr(func, "_schema"):  # a torch.nn.init function: all take a generator
        return func, {**kwargs, "generator": gen}
    if any(a.name == "generator" for a in func._schema.arguments):
        return func, {**kwargs, "generator": gen}
    overload = "generator" if func._overloadname == "default" else \
        f"{func._overloadname}_generator"
    seeded = getattr(func.overloadpacket, overload, None)
    if seeded is None:
        raise UninitializedError(f"the random operation {func} has no form taking a generator")
    return seeded, {**kwargs, "generator": gen}


class Replayer:
    """Evaluates recorded storages of one recording on ``device``."""

    def __init__(self, recording: Recording, names: dict[int, str],
                 device: torch.device) -> None:
        self.recording, self.names, self.device = recording, names, device
        self._done: dict[tuple[int, int], torch.Tensor] = {}  # (storage, version) -> base
        self._outputs: dict[int, list[Any]] = {}  # creating step -> its flattened outputs

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """The real tensor ``t`` (a recorded meta tensor) stands for, every step applied."""
        key = t.untyped_storage()._cdata
        rec = self.recording.records[key]
        base = self.storage(key, len(rec.steps))
        return _view(base, View.of(t))

    def release_temporaries(self, keep: set[int]) -> None:
        """Forget evaluated storages not in ``keep`` (the model's), freeing temporaries."""
        self._done = {k: v for k, v in self._done.items() if k[0] in keep}
        self._outputs.clear()

    def check(self, key: int, version: int, seen: set[tuple[int, int]] | None = None) -> None:
        """Raise the :class:`UninitializedError` that :meth:`storage` would raise for a storage
        whose records say it cannot be replayed (a recorded problem, made outside the block,
        data too big to carry), walking the steps ``storage`` would run, without running
        them: a pipeline that allocates later (``vf.compile`` of a deferred model) refuses at
        compile what it could never allocate."""
        seen = set() if seen is None else seen
        if (key, version) in seen or (key, version) in self._done:
            return
        seen.add((key, version))
        rec = self.recording.records[key]
        name = self.names.get(key, "a temporary")
        _refuse_unrecorded(rec, name)
        start = _last_overwrite(rec, version)
        for step in [rec.steps[0], *rec.steps[start:version]]:
            for v in step.flat:
                if isinstance(v, Const) and v.value is None:
                    _refuse_too_big(name, v)
                if isinstance(v, Ref) and v.storage != key:
                    self.check(v.storage, v.version, seen)

    def storage(self, key: int, version: int) -> torch.Tensor:
        done = self._done.get((key, version))
        if done is not None:
            return done
        rec = self.recording.records[key]
        name = self.names.get(key, "a temporary")
        _refuse_unrecorded(rec, name)
        gen: list[torch.Generator] = []

        def generator() -> torch.Generator:
            if not gen:
                g = torch.Generator(device=self.device)
                g.manual_seed(stream_seed(self.recording.seed, name))
                gen.append(g)
            return gen[0]

        with torch.no_grad():
            create = rec.steps[0]
            outputs = self._outputs.get(create.ident)
            if outputs is None:
                outputs = self._call(create, key, None, 0, generator)
                if len(outputs) > 1:
                    self._outputs[create.ident] = outputs
            base = outputs[create.output]
            if base.untyped_storage().nbytes() != rec.nbytes:
                raise UninitializedError(
                    f"{name}: {create.func} made {base.untyped_storage().nbytes()} bytes on "
                    f"{self.device}, {rec.nbytes} on meta; it cannot be replayed there")
            start = _last_overwrite(rec, version)
            for i, step in enumerate(rec.steps[start:version], start=start):
                if step.random and rec.skipped:
                    continue  # vf.skip_init: left for a checkpoint to fill (and marked)
                self._call(step, key, base, i, generator)
        self._done[(key, version)] = base
        return base

    def _call(self, step: Step, key: int, base: torch.Tensor | None, at: int,
              generator: Any) -> list[Any]:
        values = [self._value(v, key, base, at) for v in step.flat]
        args, kwargs = flatten_again(step, values)
        func = step.func
        if step.random:
            func, kwargs = _with_generator(func, kwargs, generator())
        out = func(*args, **kwargs)
        flat, _ = torch.utils._pytree.tree_flatten(out)
        return flat

    def _value(self, v: Any, key: int, base: torch.Tensor | None, at: int) -> Any:
        if isinstance(v, torch.device) and v.type == "meta":
            return self.device
        if isinstance(v, Const):
            if v.value is None:
                _refuse_too_big(self.names.get(key, "a temporary"), v)
            return v.value.to(self.device, copy=True)
        if not isinstance(v, Ref):
            return v
        if v.storage == key:  # the storage being made, read or written by its own step
            if base is None or v.version != at:
                raise UninitializedError(f"{self.names.get(key)}: reads itself out of order")
            return _view(base, v.view)
        return _view(self.storage(v.storage, v.version), v.view)


def _refuse_unrecorded(rec: StorageRecord, name: str) -> None:
    if rec.problem is not None:
        raise UninitializedError(f"{name}: {rec.problem}")
    if not rec.created:
        raise UninitializedError(
            f"{name} is on the meta device but was not created inside vf.deferred_init "
            "(made before the block, or by code the recorder did not see): build the "
            "whole model inside the block, or load this tensor from a checkpoint")


def _refuse_too_big(name: str, value: Const) -> None:
    raise UninitializedError(
        f"{name} is computed from {value.what}: too big to carry exactly (over "
        "varuna_fx.init.record.CARRY_LIMIT bytes). Build it inside the block from torch "
        "operations, or load it from a checkpoint")


def _view(base: torch.Tensor, view: View) -> torch.Tensor:
    """The tensor with ``view``'s geometry over ``base``'s storage."""
    if View.of(base) == view:
        return base
    out = torch.empty(0, dtype=view.dtype, device=base.device)
    with torch.no_grad():
        out.set_(base.untyped_storage(), view.offset, view.size, view.stride)
    return out
