"""The key of a capture, taken from the model *before* tracing it, so a hit skips the tracer.

Capture is most of a compile of a big model (torch.export of the 70B Llama's 80 layers: 19-25
CPU s, bench/RESULTS.md), and a restarted or joining process of a job captures the same model
again. What a capture produces depends on the model's code, its state and the example inputs;
the key hashes all three as far as they can be seen without running forward:

* **code**: the bytecode, constants and names of every module class's ``forward`` and of every
  Python function reachable from it (globals it reads, methods of the model's classes it
  calls, functions in closures, defaults, containers and ``__wrapped__``), outside torch and
  the standard library (their versions stand for their code);
* **what the code reads**: every global a walked function names, described whole: containers
  item by item and recursively, objects (a ``SimpleNamespace`` or dataclass config, parsed
  ``argparse`` flags) field by field, functions by identity and code (``ACT = torch.relu``
  and ``ACT = torch.sigmoid`` are two keys), tensors and arrays by their content, a module
  used as a namespace (``config.ACT``, ``sys.argv``) by the attributes the code names;
  closure cells and defaults the same way;
* **state**: every module's path, class, ``training`` flag and attributes (described as
  globals are), every parameter's and buffer's name, shape, dtype, device, ``requires_grad``
  and which are tied;
* **inputs**: the example tensors' names, shapes, dtypes and devices; the constant inputs; the
  tracer asked for; torch's default dtype, grad and autocast modes. The torch, Python and
  varuna_fx versions and varuna_fx's source are the cache service's part of every key.

Not cacheable (``capture_key`` returns None, the model is captured each time): a module with
hooks or global hooks; anything the code reads that cannot be described (an object with
neither fields nor a repr that shows its state, a torch ``Generator``, a module outside the
model, a tensor over 64 MiB): what the key cannot describe is never trusted. Python's own
objects that hold no state a graph could depend on (a lock) are described by their type, a
logger or compiled pattern by its repr. Code is hashed as bytecode, so a class defined in a
notebook cell is keyed like any other. Code reached another way than the walk (a class's
methods called from outside the model) is seen through the check of loaded source files
that ``capture_cache`` makes.
"""

from __future__ import annotations

import argparse
import enum
import functools
import hashlib
import sys
import types
from typing import Any

import numpy as np
import torch
from torch import nn

from .capture_cache import CACHE
from .inputs import BoundInputs

FORMAT = 2  # 2: every global the code reads is described
MAX_FUNCTIONS = 20000  # a walk past this many functions is not worth a key: capture instead
_PLAIN = (bool, int, float, str, bytes, type(None), complex)
_INTERNAL = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks", "_is_full_backward_hook", "_forward_hooks_always_called",
})
# fields whose value differs from process to process (Python's string hashes are salted per
# process): Hugging Face's GenerationConfig keeps the hash of its own contents
_PROCESS_LOCAL = frozenset({"_original_object_hash"})
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs")


class _NotKeyable(Exception):  # noqa: N818 - a reason to capture afresh, never shown
    pass


def capture_key(model: nn.Module, bound: BoundInputs, tracer: str) -> str | None:
    """The key of capturing ``model`` on ``bound`` with ``tracer``; None when it cannot be had
    without tracing (see the module docstring)."""
    from torch.nn.modules import module as nn_module

    if any((nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks,
            nn_module._global_backward_hooks, nn_module._global_backward_pre_hooks)):
        return None
    walk = _Walk()
    try:
        state = _state(model, walk)
        inputs = ([(n, _tensor(t)) for n, t in bound.tensors.items()],
                  walk.describe(dict(bound.constants)), bound.batch_size)
        for cls in {type(m) for m in model.modules()}:
            walk.add(getattr(cls, "forward", None))
            walk.classes.append(cls)
        code = walk.run()
    except _NotKeyable:
        return None
    modes = (str(torch.get_default_dtype()), torch.is_grad_enabled(),
             tuple((torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d)))
                   for d in ("cpu", "cuda")))
    # the versions and varuna_fx's source are the cache service's part of the key
    return CACHE.key(repr((FORMAT, tracer, state, inputs, code, modes)))


def _state(model: nn.Module, walk: _Walk) -> list[Any]:
    first_name: dict[int, str] = {}
    out = []
    for path, module in model.named_modules(remove_duplicate=False):
        if any(getattr(module, h, None) for h in _HOOKS):
            raise _NotKeyable(f"hooks on {path}")
        tensors = []
        for kind, table in (("p", module._parameters), ("b", module._buffers)):
            for name, t in table.items():
                fqn = f"{path}.{name}" if path else name
                tie = first_name.setdefault(id(t), fqn) if t is not None else None
                persistent = name not in module._non_persistent_buffers_set
                tensors.append((kind, name, None if t is None else _tensor(t), tie, persistent))
        attributes = sorted((k, walk.describe(v)) for k, v in vars(module).items()
                            if k not in _INTERNAL and k not in _HOOKS)
        out.append((path, _qualname(type(module)), module.training, tensors, attributes,
                    list(module._modules)))
    return out


def _tensor(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), str(t.dtype), str(t.device), bool(t.requires_grad),
            isinstance(t, nn.Parameter), t.layout != torch.strided)


class _Walk:
    """Describes values and collects the code reachable from them, each function once."""

    def __init__(self) -> None:
        self.todo: list[Any] = []
        self.seen: set[int] = set()
        self.classes: list[type] = []  # the model's module classes: `self.name` is looked up
        self.described: dict[int, Any] = {}
        self._members: dict[str, list[Any]] | None = None
        self.active: set[int] = set()

    def add(self, fn: Any) -> None:
        if fn is not None and id(fn) not in self.seen:
            self.seen.add(id(fn))
            self.todo.append(fn)

    def run(self) -> list[Any]:
        out = []
        while self.todo:
            if len(self.seen) > MAX_FUNCTIONS:
                raise _NotKeyable("too much code")
            out.append(self._function(self.todo.pop()))
        return sorted(out, key=repr)

    def _function(self, fn: Any) -> Any:
        wrapped = getattr(fn, "__wrapped__", None)
        if wrapped is not None:
            self.add(wrapped)
        if isinstance(fn, (staticmethod, classmethod)):
            self.add(fn.__func__)
            return ("wrapper", type(fn).__name__)
        if isinstance(fn, functools.partial):
            self.add(fn.func)
            return ("partial",)
        if isinstance(fn, types.MethodType):
            self.add(fn.__func__)
            return ("method", _qualname(type(fn.__self__)))
        code = getattr(fn, "__code__", None)
        name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}"
        if code is None or _not_walked(fn):
            return ("builtin", name)
        names: set[str] = set()
        body = _code(code, names)
        globals_ = getattr(fn, "__globals__", {})
        # every global the code names, described whole: a config dict or namespace, a function
        # alias (ACT = torch.relu), a tensor, flags parsed at start; what cannot be described
        # makes the model uncacheable (captured each time), never a trusted key
        read = [(n, self.global_value(globals_[n], names)) for n in sorted(names)
                if n in globals_]
        for n in sorted(names):
            for member in self.members().get(n, ()):
                self.add(member)
        cells = [self.describe(c.cell_contents, 1) for c in (fn.__closure__ or ()) if _filled(c)]
        defaults = [self.describe(v, 1) for v in [*(fn.__defaults__ or ()),
                                                  *(fn.__kwdefaults__ or {}).values()]]
        return (name, body, read, cells, defaults)

    def global_value(self, value: Any, names: set[str]) -> Any:
        """A global a function reads: a module by name and the attributes of it the code
        names (``config.ACT``, ``sys.argv``: torch's own module attributes are torch's code);
        a class by name (its code is the files check's); anything else by :meth:`describe`."""
        if isinstance(value, types.ModuleType):
            if value.__name__.split(".")[0] == "torch":
                return ("module", value.__name__)
            return ("module", value.__name__, [
                (n, self.global_value(vars(value)[n], set())) for n in sorted(names)
                if n in vars(value) and not isinstance(vars(value)[n], types.ModuleType)])
        if isinstance(value, type):
            return ("class", _qualname(value))
        if isinstance(value, nn.Module):  # a module outside the model (a hub kernel's wrapper)
            return self.global_module(value)
        return self.describe(value)

    def global_module(self, module: nn.Module) -> Any:
        """A module the code reads as a global: every submodule's class, attributes and
        tensors by content (none of it is the model's, so none of it is walked elsewhere),
        and its classes' code."""
        out = []
        for path, sub in module.named_modules(remove_duplicate=False):
            if any(getattr(sub, h, None) for h in _HOOKS):
                raise _NotKeyable(f"hooks on a global module's {path}")
            self.add(getattr(type(sub), "forward", None))
            self.classes.append(type(sub))
            self._members = None  # the classes grew: their methods are looked up again
            tensors = [(kind, name, None if t is None else _tensor(t) + (_content(t),))
                       for kind, table in (("p", sub._parameters), ("b", sub._buffers))
                       for name, t in table.items()]
            attributes = sorted((k, self.describe(v, 1)) for k, v in vars(sub).items()
                                if k not in _INTERNAL and k not in _HOOKS)
            out.append((path, _qualname(type(sub)), sub.training, tensors, attributes))
        return ("global module", out)

    def members(self) -> dict[str, list[Any]]:
        """Name -> the functions the model's classes (and their bases) define under it."""
        if self._members is None:
            self._members = {}
            for klass in {k for cls in self.classes for k in cls.__mro__}:
                if _not_walked(klass):
                    continue
                for name, member in vars(klass).items():
                    if isinstance(member, property):
                        member = member.fget
                    if isinstance(member, (types.FunctionType, staticmethod, classmethod)):
                        self._members.setdefault(name, []).append(member)
        return self._members

    def describe(self, value: Any, depth: int = 0) -> Any:
        """A value as plain data (see the module docstring); raises when it cannot be."""
        if isinstance(value, _PLAIN) or isinstance(value, (torch.dtype, torch.device,
                                                           torch.layout, torch.memory_format)):
            return (type(value).__name__, repr(value))
        if depth > 6:
            raise _NotKeyable("too deep")
        key = id(value)
        if key in self.described:
            return self.described[key]
        if key in self.active:
            return ("cycle", type(value).__name__)
        self.active.add(key)
        try:
            out = self._describe(value, depth)
        finally:
            self.active.discard(key)
        self.described[key] = out
        return out

    def _describe(self, value: Any, depth: int) -> Any:
        d = depth + 1
        if isinstance(value, (list, tuple)):  # subclasses too: their items and their fields
            return (_qualname(type(value)), [self.describe(x, d) for x in value],
                    self._fields(value, d))
        if isinstance(value, (set, frozenset)):
            return (type(value).__name__, sorted((self.describe(x, d) for x in value), key=repr))
        if isinstance(value, dict):
            return (_qualname(type(value)), [(self.describe(k, d), self.describe(v, d))
                                             for k, v in value.items()], self._fields(value, d))
        if isinstance(value, torch.Tensor):
            return _tensor(value) + (_content(value),)
        if isinstance(value, np.ndarray):
            return ("ndarray", str(value.dtype), value.shape, _bytes_digest(value))
        if isinstance(value, np.generic):
            return ("numpy", type(value).__name__, repr(value.item()))
        if isinstance(value, type):
            return ("class", _qualname(value))
        if isinstance(value, nn.Module):  # its state is walked as the model's (named_modules)
            return ("module", _qualname(type(value)))
        if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return ("operator", str(value))
        if isinstance(value, _FUNCTIONS):
            self.add(value)
            if isinstance(value, functools.partial):
                return ("partial", self.describe((value.func, value.args, value.keywords), d))
            if isinstance(value, types.MethodType):  # which object it is bound to, too
                return ("method", self.describe(value.__func__, d),
                        self.describe(value.__self__, d))
            # by identity and code: `ACT = f` and `ACT = g` are other keys, lambdas included
            code = getattr(value, "__code__", None)
            return ("function", getattr(value, "__module__", ""),
                    getattr(value, "__qualname__", repr(value)),
                    _code(code, set()) if isinstance(code, types.CodeType) else None)
        if isinstance(value, enum.Enum):
            return ("enum", _qualname(type(value)), repr(value.value))
        if isinstance(value, types.ModuleType):
            return ("module", value.__name__)
        wrapped = _wrapped(value)
        if wrapped is not None:  # a functools.lru_cache of a function, and the like
            self.add(wrapped)
            return ("wrapped", _qualname(type(value)), self.describe(wrapped, d))
        if _not_walked(type(value)) and not isinstance(value, _NAMESPACES):
            # Python's and torch's own objects (a logger, a lock, a compiled pattern): by their
            # repr where it shows their state, else (a lock) by type where they are Python's
            text = repr(value)
            if " at 0x" not in text:
                return ("repr", _qualname(type(value)), text)
            if type(value).__module__.split(".")[0] in sys.stdlib_module_names:
                return ("stdlib", _qualname(type(value)))
            raise _NotKeyable(f"cannot describe a {type(value).__name__}")
        fields = getattr(value, "__dict__", None)
        if isinstance(fields, dict):
            return ("object", _qualname(type(value)), self._fields(value, d))
        text = repr(value)  # no fields (__slots__): its own repr, if it says more than its id
        if " at 0x" not in text and " object at " not in text:
            return ("repr", _qualname(type(value)), text)
        raise _NotKeyable(f"cannot describe a {type(value).__name__}")

    def _fields(self, value: Any, depth: int) -> list[Any]:
        fields = getattr(value, "__dict__", None)
        if not isinstance(fields, dict):
            return []
        return sorted(((k, self.describe(v, depth)) for k, v in fields.items()
                       if k not in _PROCESS_LOCAL), key=repr)


_FUNCTIONS = (types.FunctionType, types.MethodType, staticmethod, classmethod,
              types.BuiltinFunctionType, types.MethodWrapperType, types.WrapperDescriptorType,
              types.MethodDescriptorType, types.ClassMethodDescriptorType, functools.partial)
# Python's objects described by their fields, as a user's object is: configs and parsed flags
_NAMESPACES = (types.SimpleNamespace, argparse.Namespace)


def _code(code: types.CodeType, names: set[str]) -> tuple:
    names.update(code.co_names)
    consts = tuple(_code(c, names) if isinstance(c, types.CodeType) else
                   # a frozenset's order follows the process's string hashes
                   repr(sorted(map(repr, c))) if isinstance(c, frozenset) else repr(c)
                   for c in code.co_consts)
    return (code.co_code, consts, code.co_names, code.co_freevars, code.co_flags)


def _wrapped(value: Any) -> Any:
    if not callable(value):
        return None
    try:
        wrapped = getattr(value, "__wrapped__", None)
    except Exception:  # noqa: BLE001 - an object whose __getattr__ raises: nothing wrapped
        return None
    return wrapped if isinstance(wrapped, (types.FunctionType, types.BuiltinFunctionType)) \
        else None


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
        return True
    except ValueError:
        return False


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _content(t: torch.Tensor) -> str:
    if t.is_meta or t.layout != torch.strided:
        return ""
    if t.numel() * t.element_size() > 64 << 20:
        raise _NotKeyable("a large tensor attribute")
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return _bytes_digest(data.numpy())


def _bytes_digest(array: np.ndarray) -> str:
    if array.nbytes > 64 << 20:
        raise _NotKeyable("a large array")
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()




_NOT_WALKED = frozenset({"torch", *sys.stdlib_module_names})


def _not_walked(obj: Any) -> bool:
    """Code torch's or Python's version stands for (it is not walked)."""
    module = getattr(obj, "__module__", None) or ""
    return module.split(".")[0] in _NOT_WALKED


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
