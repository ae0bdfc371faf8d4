"""``vf.skip_init()``: build a model without initialising its tensors, to load them next.

A process that resumes from a checkpoint overwrites every weight it builds, yet building a
model spends most of its time drawing random numbers in ``torch.nn.init``, in a restart that
should take seconds (bench/RESULTS.md, "Figures the code cites"). Under ``skip_init`` the random
initialisers of ``torch.nn.init`` (``normal_``, ``uniform_``, ``kaiming_uniform_``... and so
every standard module's ``reset_parameters``) return their tensor untouched: ``torch.empty``'s
garbage, or whatever the tensor held. The deterministic fills (``zeros_``, ``ones_``,
``constant_``, ``eye_``, ``dirac_``) run as usual: a memset, and always right.

Never a silent wrong result: every tensor an init function skipped is marked -- the tensor
object (which follows ``model.double()``/``.to()``, as they swap ``.data`` under the same
``Parameter``) and the byte range of its storage (which follows a ``Parameter`` wrapped around
an initialised plain tensor). ``pipe.load_checkpoint`` and ``pipe.load_state_dict`` clear the
marks of what they load; a pipeline refuses to step or evaluate while it holds a marked tensor
(``Pipeline._check_loaded``). Copies (``clone``, ``copy.deepcopy``, a ``state_dict`` saved to disk)
are not tracked. Marks are weak: a tensor that dies takes its mark with it.

Threads: the init functions are module attributes, so they are replaced process-wide while any
thread is inside ``skip_init``; the replacements skip only for threads inside it (a thread-local
depth) and call the original everywhere else, and the originals are restored, under a lock,
when the last thread leaves -- also when the body raises.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.init as nn_init

from ..errors import UninitializedError
from .record import mark_skipped

# the random initialisers of torch.nn.init (drawing numbers is the cost): public, their
# deprecated aliases (which call the public ones through a closure, not the module attribute)
# and the private helpers some libraries call directly. The deterministic fills (zeros_, ones_,
# constant_, eye_, dirac_) still run: they cost a memset and keep right what a checkpoint may
# not hold, such as a non-persistent buffer a model zeroes with init.zeros_ (BERT's
# token_type_ids in transformers).
_NAMES = ("uniform_", "normal_", "trunc_normal_", "xavier_uniform_", "xavier_normal_",
          "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_", "uniform", "normal",
          "xavier_uniform", "xavier_normal", "kaiming_uniform", "kaiming_normal", "orthogonal",
          "sparse", "_no_grad_uniform_", "_no_grad_normal_", "_no_grad_trunc_normal_")

_patch_lock = threading.Lock()
_inside = 0  # threads inside skip_init (the replacements are installed while > 0)
_originals: dict[str, Callable[..., Any]] = {}
_local = threading.local()

# re-entrant: a weak reference's callback may run (garbage collection) while this thread holds it
_marks_lock = threading.RLock()
_objects: dict[int, weakref.ref] = {}  # id(tensor) -> weak reference to the marked tensor
# id(storage) -> (weak reference to the storage, the byte ranges [start, end) never written)
_storages: dict[int, tuple[weakref.ref, list[tuple[int, int]]]] = {}


@contextlib.contextmanager
def skip_init(enabled: bool = True) -> Iterator[None]:
    """Build a model without initialising its tensors, for a process that loads them next::

        with vf.skip_init(enabled=resume is not None):
            model = build()
        pipe = vf.compile(model, ...)
        if resume is not None:
            pipe.load_checkpoint(resume, optimizer=opt)

    ``torch.nn.init``'s random initialisers leave their tensor as it is (uninitialised memory)
    and mark it (its deterministic fills, ``zeros_``, ``ones_``..., still run);
    a pipeline holding a marked tensor that no ``pipe.load_checkpoint`` / ``pipe.load_state_dict``
    filled raises :class:`~varuna_fx.errors.UninitializedError` instead of training on garbage.
    ``enabled=False`` does nothing. Initialisation written without ``torch.nn.init``
    (``torch.randn``, ``tensor.normal_()``) still runs, and is not marked."""
    if not enabled:
        yield
        return
    _enter()
    try:
        yield
    finally:
        _leave()


def _enter() -> None:
    global _inside
    with _patch_lock:
        if _inside == 0:
            for name in _NAMES:
                original = getattr(nn_init, name, None)
                if original is not None:
                    _originals[name] = original
                    setattr(nn_init, name, _skipping(original))
        _inside += 1
    _local.depth = getattr(_local, "depth", 0) + 1


def _leave() -> None:
    global _inside
    _local.depth -= 1
    with _patch_lock:
        _inside -= 1
        if _inside == 0:
            for name, original in _originals.items():
                setattr(nn_init, name, original)
            _originals.clear()


def _skipping(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init(*args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "depth", 0) == 0:  # another thread, outside skip_init
            return original(*args, **kwargs)
        tensor = args[0] if args else kwargs.get("tensor")
        if isinstance(tensor, torch.Tensor):
            mark(tensor)
        return tensor

    return init


# -- marks ---------------------------------------------------------------------------------------


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes of ``t``'s storage that ``t`` covers (with any gaps of a strided view)."""
    if t.numel() == 0:
        return None
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    item = t.element_size()
    return t.storage_offset() * item, (t.storage_offset() + last + 1) * item


def _is_dense(t: torch.Tensor, span: tuple[int, int]) -> bool:
    return span[1] - span[0] == t.numel() * t.element_size()


def mark(tensor: torch.Tensor) -> None:
    """Record ``tensor`` as never initialised (what a skipped init function does)."""
    if tensor.is_meta:  # under vf.deferred_init: materialising allocates and marks it
        mark_skipped(tensor)
        return
    with _marks_lock:
        key = id(tensor)
        _objects[key] = weakref.ref(tensor, lambda _, k=key: _forget(_objects, k))
        span = _span(tensor)
        if span is None:
            return
        storage = tensor.untyped_storage()
        skey = id(storage)
        if skey not in _storages:
            _storages[skey] = (weakref.ref(storage, lambda _, k=skey: _forget(_storages, k)),
                               [])
        _storages[skey][1].append(span)


def _forget(table: dict[int, Any], key: int) -> None:
    with _marks_lock:
        table.pop(key, None)


def loaded(tensors: Iterable[torch.Tensor]) -> None:
    """``tensors`` were overwritten completely (a checkpoint or state dict was copied into
    them): clear their marks."""
    if not any_marked():
        return
    with _marks_lock:
        for t in tensors:
            ref = _objects.get(id(t))
            if ref is not None and ref() is t:
                del _objects[id(t)]
            span = _span(t)
            entry = _storages.get(id(t.untyped_storage())) if span is not None else None
            # a strided view with gaps did not write the bytes between its elements
            if entry is None or span is None or not _is_dense(t, span):
                continue
            ranges: list[tuple[int, int]] = []
            for start, end in entry[1]:
                if start < span[0]:
                    ranges.append((start, min(end, span[0])))
                if end > span[1]:
                    ranges.append((max(start, span[1]), end))
            if ranges:
                entry[1][:] = ranges
            else:
                del _storages[id(t.untyped_storage())]


def is_marked(t: torch.Tensor) -> bool:
    ref = _objects.get(id(t))
    if ref is not None and ref() is t:
        return True
    span = _span(t)
    if span is None:
        return False
    entry = _storages.get(id(t.untyped_storage()))
    return entry is not None and any(start < span[1] and span[0] < end
                                     for start, end in entry[1])


def any_marked() -> bool:
    """Whether any live tensor is marked (false unless skip_init skipped something)."""
    return bool(_objects or _storages)


def unloaded(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the tensors that ``skip_init`` left uninitialised and no load filled."""
    if not any_marked():  # the usual case: nothing was ever skipped
        return []
    with _marks_lock:
        return [n for n, t in named if is_marked(t)]


def raise_unloaded(names: list[str], where: str = "") -> None:
    """The error for tensors :func:`unloaded` found (``where``: e.g. " on rank 1")."""
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    raise UninitializedError(
        f"{len(names)} parameter(s)/buffer(s) built under vf.skip_init() were never loaded"
        f"{where}: {shown}. They hold uninitialised memory: load them before stepping "
        "(pipe.load_checkpoint(path), or pipe.load_state_dict(state) -- a model.load_state_dict "
        "is not tracked) or build the model without skip_init (skip_init(enabled=False) when "
        "not resuming). A buffer that checkpoints do not hold (persistent=False) must not be "
        "initialised with torch.nn.init under skip_init"
    )
