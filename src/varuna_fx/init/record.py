"""``vf.deferred_init``: build a model on the meta device and record how each tensor is made.

The model's own construction code runs unchanged under three nested modes: torch's
``torch.device("meta")`` (factories allocate nothing), a function mode that turns Python data
(``torch.tensor([...])``) into a CPU tensor the recorder can see, and a dispatch mode that
records every aten operation producing or writing a meta tensor. Recording is per *storage*
(views share their base's): a storage's record is the operation that created it followed by
every in-place operation that wrote it (``uniform_``, ``normal_``, ``fill_``, ``zero_``,
``copy_``..., also through views such as ``weight[padding_idx].zero_()`` or ``.data``). Tensor
arguments are kept as :class:`Ref` (storage, view geometry, how many of its steps had run):
``copy_`` from another recorded tensor, rotary ``inv_freq = 1 / base ** (arange / dim)``, causal
masks ``tril(ones)`` and ``arange(n).expand(1, -1)`` replay from their own inputs. Operating at
the aten level covers ``torch.nn.init``, ``reset_parameters``, Hugging Face's ``_init_weights``
and anything else written with torch ops, with no patching of the user's code.

``torch.nn.init``'s ``trunc_normal_``, ``orthogonal_``, ``sparse_`` and ``dirac_`` return at
once for a meta tensor, after reading its ``is_meta``: while a block runs that read is
intercepted (a property on ``torch.Tensor`` shadowing the C one) and, when it comes from one of
those functions' code, the call is recorded with the arguments in its frame. So the function is
caught however the model's code reached it (``from torch.nn.init import orthogonal_`` at import
time included), not only through the module attribute.

Code that reads a meta tensor's values while the model is built (``if w.abs().max() > 0.1:``,
``.item()``, ``.tolist()``) is refused with an :class:`InputError` naming its source line.

What the recorder did not see is kept exactly when small: a CPU tensor copied into the meta
world (``torch.tensor(list)``, ``from_numpy``, ``torch.load``) of at most :data:`CARRY_LIMIT`
bytes is stored (:class:`Const`); a bigger one is recorded as a problem, and materialising the
tensor raises naming it (``replay.py``). Storages live in :data:`_LIVE` (weakly keyed by the
recording, which holds them strongly, so storage addresses are never reused while recorded).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import linecache
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.init as nn_init
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import InputError

CARRY_LIMIT = 1 << 20  # bytes of unrecorded data kept exactly (a vocabulary mask, a table)


@dataclass(frozen=True)
class View:
    """Where a tensor lies in its storage."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> View:
        return cls(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)


@dataclass(frozen=True)
class Ref:
    """A recorded tensor as an argument: ``storage`` after its first ``version`` steps."""

    storage: int
    view: View
    version: int


@dataclass(frozen=True)
class Const:
    """A tensor the recorder did not make: its data (None when too big to carry)."""

    value: torch.Tensor | None
    what: str


@dataclass
class Step:
    """One aten call: ``flat`` are its (args, kwargs) flattened, tensors as Ref/Const."""

    func: Any
    flat: list[Any]
    spec: Any
    output: int | None = None  # creation: which flattened output is the storage
    random: bool = False
    python: bool = False  # a torch.nn.init function (replayed as itself), not an aten op
    ident: int = field(default_factory=lambda: next(_ids))


_ids = itertools.count()


@dataclass
class StorageRecord:
    key: int
    nbytes: int
    steps: list[Step] = field(default_factory=list)  # steps[0] creates, the rest write
    created: bool = False
    skipped: bool = False  # vf.skip_init skipped a random initialiser here: load it
    problem: str | None = None  # why its values cannot be replayed


class Recording:
    """Everything one ``deferred_init`` block recorded."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.records: dict[int, StorageRecord] = {}
        self._alive: list[Any] = []  # the meta storages: their addresses stay unique
        self.names: dict[int, str] | None = None  # storage -> name, fixed at the first use

    def record_of(self, t: torch.Tensor, create: bool = False) -> StorageRecord | None:
        storage = t.untyped_storage()
        key = storage._cdata
        rec = self.records.get(key)
        if rec is None and create:
            rec = self.records[key] = StorageRecord(key, storage.nbytes())
            self._alive.append(storage)
        return rec

    def ref(self, t: torch.Tensor) -> Ref | Const:
        if not t.is_meta:
            if t.untyped_storage().nbytes() <= CARRY_LIMIT:
                return Const(t.detach().clone(), f"a {tuple(t.shape)} {t.device} tensor")
            return Const(None, f"a {tuple(t.shape)} {t.dtype} tensor on {t.device} "
                         f"({t.untyped_storage().nbytes()} bytes) that was not built under "
                         "vf.deferred_init (from_numpy, torch.load, a file...)")
        rec = self.record_of(t, create=True)
        assert rec is not None
        return Ref(rec.key, View.of(t), len(rec.steps))


# torch.nn.init functions that return at once for a meta tensor (so nothing reaches the
# dispatch mode) and have no __torch_function__ hook: replaced while a block runs, in this
# module's namespace only, and recorded as one step that calls the original on real storage
_PYTHON_INITS = ("trunc_normal_", "orthogonal_", "sparse_", "dirac_")
TRUE_INITS = {name: getattr(nn_init, name) for name in _PYTHON_INITS}
# the code whose ``tensor.is_meta`` read is the init function returning early for meta
_INIT_CODES = {TRUE_INITS[n].__code__: n for n in ("orthogonal_", "sparse_", "dirac_")}
_INIT_CODES[nn_init._no_grad_trunc_normal_.__code__] = "trunc_normal_"  # trunc_normal_'s check
_IS_META = torch._C.TensorBase.is_meta
_patch_lock = threading.Lock()
_patched: list[dict[str, Any]] = []  # the attributes replaced, one dict per open block

_LIVE: list[Recording] = []  # recordings whose models may still be materialised
_state = threading.local()


def active() -> Recording | None:
    """The recording of the ``deferred_init`` block this thread is in, if any."""
    return getattr(_state, "recording", None)


def lookup(t: torch.Tensor) -> tuple[Recording, StorageRecord] | None:
    """The recording and record of a meta tensor built under ``deferred_init``."""
    if not t.is_meta:
        return None
    key = t.untyped_storage()._cdata
    for recording in reversed(_LIVE):
        rec = recording.records.get(key)
        if rec is not None and rec.created:
            return recording, rec
    return None


def _mutated(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes, from its schema (``normal_``'s self, an ``out=``)."""
    found = []
    for k, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[k] if k < len(args) else kwargs.get(arg.name)
        if isinstance(value, torch.Tensor):
            found.append(value)
    return found


def _is_random(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


class _Recorder(TorchDispatchMode):
    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        flat_in, spec = tree_flatten((args, kwargs))
        touches_meta = any(isinstance(x, torch.Tensor) and x.is_meta for x in flat_in) or \
            any(isinstance(x, torch.device) and x.type == "meta" for x in flat_in)
        if not touches_meta:
            return func(*args, **kwargs)
        rec = self.recording
        written = _mutated(func, args, kwargs)
        # the arguments as they are before the call (a Ref's version counts the steps so far)
        refs = [rec.ref(x) if isinstance(x, torch.Tensor) else x for x in flat_in]
        out = func(*args, **kwargs)
        random = _is_random(func)
        # computed from what vf.skip_init skipped (a .to(dtype) copy of it): a load fills it too
        skipped = any(isinstance(r, Ref) and rec.records[r.storage].skipped for r in refs)
        if written:
            for t in written:
                if t.is_meta:
                    target = rec.record_of(t, create=True)
                    assert target is not None
                    target.steps.append(Step(func, refs, spec, random=random))
                    target.skipped |= skipped
                    if len(written) > 1:
                        target.problem = f"{func} writes several tensors at once"
            return out
        in_storages = {x.untyped_storage()._cdata for x in flat_in
                       if isinstance(x, torch.Tensor) and x.is_meta}
        flat_out, _ = tree_flatten(out)
        step = None
        for k, o in enumerate(flat_out):
            if not isinstance(o, torch.Tensor) or not o.is_meta:
                continue
            key = o.untyped_storage()._cdata
            if key in in_storages:  # a view of an input: nothing new to record
                continue
            step = step or Step(func, refs, spec, random=random)
            made = rec.record_of(o, create=True)
            assert made is not None
            if made.created or made.steps:  # an address reused: cannot happen while alive
                made.problem = "recorded twice"
            made.steps.append(Step(func, refs, spec, output=k, random=random, ident=step.ident))
            made.created = True
            made.skipped = skipped
        return out


# Python data becomes a CPU tensor first, so the recorder sees (and keeps) its values.
_DATA_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray}
# what reads a tensor's values into Python: a meta tensor has none
_VALUE_READS = {torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist,
                torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__,
                torch.Tensor.__complex__, torch.Tensor.numpy}
_LIBRARIES = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, contextlib, sys.modules[
    __name__.rsplit(".", 2)[0]]) if m.__file__)


def _user_line() -> str:
    """``file:line: code`` of the innermost frame outside torch and varuna_fx."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame = frame.f_back
    if frame is None:
        return "the model's code"
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" + (f" ({code})" if code else "")


class _DataToCpu(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _VALUE_READS and args and isinstance(args[0], torch.Tensor) and \
                _IS_META.__get__(args[0]):
            raise InputError(
                f"{_user_line()} reads the values of a tensor while the model is built under "
                "vf.deferred_init, where tensors live on the meta device and have none yet "
                f"({getattr(func, '__name__', func)} of a {tuple(args[0].shape)} tensor). Make "
                "that code not depend on values (decide from shapes or configuration), or "
                "build this model without vf.deferred_init (for a model that fits, a normal "
                "build; vf.skip_init when a checkpoint is loaded next)")
        if func in _DATA_FACTORIES:
            device = kwargs.get("device")
            if device is None or torch.device(device).type == "meta":
                with torch.device("cpu"):  # innermost: beats the outer meta default
                    real = func(*args, **{**kwargs, "device": "cpu"})
                if real.numel() == 0 and device is None:
                    # ``torch.tensor([]).device`` is how code asks for the default device
                    # (Hugging Face's init_weights skips every initialiser when it says
                    # meta): an empty tensor holds no data, so it may stay where it says
                    return real
                return real.to("meta")
        return func(*args, **kwargs)


@contextlib.contextmanager
def deferred_init(seed: int = 0) -> Iterator[Recording]:
    """Build a model with nothing allocated, recording how every tensor is initialised::

        with vf.deferred_init(seed=0):
            model = build_model()
        pipe = vf.compile(model, example_inputs=..., loss_fn=...)   # or vf.materialize(model)

    Parameters and buffers live on the meta device; ``vf.compile`` allocates on each rank
    only its stage's tensors and replays their initialisers there, each random one drawing
    from a generator keyed by (``seed``, the tensor's canonical FQN), so the values are the
    same on every layout. ``vf.materialize(model)`` makes the whole model in this process."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InputError(f"deferred_init(seed={seed!r}): give an integer seed")
    if active() is not None:
        raise InputError("vf.deferred_init blocks do not nest: build the model in one block")
    recording = Recording(seed)
    _LIVE.append(recording)
    _state.recording = recording
    _patch()
    try:
        with torch.device("meta"), _DataToCpu(), _Recorder(recording):
            yield recording
    finally:
        _state.recording = None
        _unpatch()


def _patch() -> None:
    with _patch_lock:
        previous = {name: getattr(nn_init, name) for name in _PYTHON_INITS}
        _patched.append(previous)
        for name in _PYTHON_INITS:
            setattr(nn_init, name, _recording_init(name, previous[name]))
        if len(_patched) == 1:  # (blocks of other threads share it)
            torch.Tensor.is_meta = property(_is_meta)  # type: ignore[method-assign,assignment]


def _unpatch() -> None:
    with _patch_lock:
        previous = _patched.pop()
        for name, fn in previous.items():
            setattr(nn_init, name, fn)
        if not _patched:
            del torch.Tensor.is_meta  # the C property again


def _is_meta(self: torch.Tensor) -> bool:
    """``Tensor.is_meta`` while a block runs: an init function of ``_INIT_CODES`` asking is
    about to skip a meta tensor, so its call is recorded here, from its frame's arguments."""
    value = _IS_META.__get__(self)
    if value and active() is not None and not getattr(_state, "in_init", False):
        frame = sys._getframe(1)
        name = _INIT_CODES.get(frame.f_code)
        if name is not None:
            code = frame.f_code
            args = [frame.f_locals[n] for n in code.co_varnames[:code.co_argcount]]
            _record_init(active(), name, tuple(args), {})  # type: ignore[arg-type]
    return value


def _recording_init(name: str, previous: Any) -> Any:
    true = TRUE_INITS[name]

    @functools.wraps(true)
    def init(*args: Any, **kwargs: Any) -> Any:
        recording = active()
        tensor = args[0] if args else kwargs.get("tensor")
        if recording is None or not isinstance(tensor, torch.Tensor) or not tensor.is_meta:
            return previous(*args, **kwargs)
        if previous is not true:  # vf.skip_init entered first: let it mark the tensor
            _state.in_init = True  # (recorded below, not again by its is_meta read)
            try:
                previous(*args, **kwargs)
            finally:
                _state.in_init = False
        return _record_init(recording, name, args, kwargs)

    return init


def _record_init(recording: Recording, name: str, args: tuple, kwargs: dict) -> Any:
    """One call of the init function ``name`` on a meta tensor, as a step of its storage that
    calls the true function on the real one."""
    tensor = args[0] if args else kwargs["tensor"]
    # replay draws from the tensor's own stream, not the generator
    kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
    params = list(inspect.signature(TRUE_INITS[name]).parameters)
    if params[-1] == "generator" and len(args) == len(params):
        args = args[:-1]
    flat, spec = tree_flatten((args, kwargs))
    refs = [recording.ref(x) if isinstance(x, torch.Tensor) else x for x in flat]
    target = recording.record_of(tensor, create=True)
    assert target is not None
    target.steps.append(Step(TRUE_INITS[name], refs, spec, random=name != "dirac_",
                             python=True))
    return tensor


def mark_skipped(t: torch.Tensor) -> None:
    """``vf.skip_init`` skipped an initialiser of this meta tensor (it will be loaded)."""
    recording = active()
    if recording is not None:
        rec = recording.record_of(t)
        if rec is not None:
            rec.skipped = True


def flatten_again(step: Step, values: list[Any]) -> tuple[tuple, dict]:
    """(args, kwargs) of ``step`` with its flattened arguments replaced by ``values``."""
    args, kwargs = tree_unflatten(values, step.spec)
    return args, kwargs
