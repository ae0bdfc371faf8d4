"""Edits to the model after ``vf.compile``: a pipeline never silently runs what it replaced.

The stage modules hold the model's own submodules, parameters and buffers (the same objects).
Replacing one afterwards (``model.block = NewBlock()``, ``model.lin.weight = nn.Parameter(...)``
for a weight a graph reads directly) leaves the stages running the old object while
``pipe.parameters()`` -- read from the model by name -- hands the optimizer the new one, which
never gets a gradient; ``model.double()`` after compile changes dtypes the plan was made for.
Eager would run the edited model, so each step checks that every object its stages hold is
still where the model keeps it, with the dtype, shape and device it had (dictionary lookups
along each path: microseconds), and asks for a new compile otherwise.

Checked per step: a submodule, parameter or buffer the stages hold replaced; its dtype, shape
or device changed; a plain attribute of a module traced into the graph changed; a parameter
frozen at compile unfrozen; a hook added to or removed from a traced module; code monkeypatched
on a traced module or its class (``model.forward = f``, ``Block.gate = g``, a changed
``__class__``). What it costs per step: bench/RESULTS.md, "Per-step model-edit check". Global
module hooks added after compile are not checked. Capture puts back every plain attribute forward's Python changed while traced and
removes the hooks forward registered while traced (a Hugging Face model installs
output-capturing hooks on its first call and marks itself: kept, each later call collected every
hidden state twice); a forward run after compile that sets such a mark is an edit like any
other.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..errors import InputError


@contextlib.contextmanager
def settings_kept(model: nn.Module) -> Iterator[None]:
    """Put every module's attributes back after the body, the same objects: tracing runs
    forward's Python, and a counter it bumps (``self.calls += 1`` on an int) must not change
    the user's model, nor look like an edit to a pipeline compiled earlier; torch.export puts
    back copies of every dict and list attribute (a HuggingFace model's ``_tp_plan``)."""
    before = [(m, dict(vars(m))) for m in model.modules()]
    # hooks forward registers (a HuggingFace model installs its output-capturing hooks on its
    # first call and marks itself with an attribute, which the loop below puts back): the
    # hook dicts are the same objects, changed in place. Kept, every capture added another
    # set, and hidden states came back once per capture, in eager and in the pipeline.
    hooks = [(d, dict(d)) for m in model.modules() for key, d in vars(m).items()
             if "hooks" in key and isinstance(d, dict)]
    try:
        yield
    finally:
        for d, contents in hooks:
            if list(d.items()) != list(contents.items()):
                d.clear()
                d.update(contents)
        for module, attributes in before:
            now = vars(module)
            # and whatever tracing added (fx keeps a tensor made in forward as the root's
            # `_tensor_constant0`; the graph module has its own reference)
            for key in now.keys() - attributes.keys():
                del now[key]
            for key, value in attributes.items():
                if now.get(key, _GONE) is not value:
                    now[key] = value


_GONE = object()


class ModelEdits:
    """The paths (in the model) of everything the stages hold, and each tensor's form."""

    def __init__(self, model: nn.Module, stage_modules: Iterable[nn.Module],
                 traced: Iterable[str] = ()) -> None:
        """``traced``: the modules whose code was traced into the graph, their plain settings
        (``self.alpha``, a torch.export Dropout's ``p``) baked in (see :func:`traced_modules`;
        a module the graph calls runs its own code at each step and follows its settings)."""
        self.model = model
        self.global_hooks = global_hooks()
        paths = set(traced)
        self.settings = [(name, m, plain_settings(m), _hooks(m), _code(m))
                         for name, m in model.named_modules() if name in paths]
        # the classes whose methods were traced (a method replaced on the class runs no more)
        classes = {c for *_, m, _s, _h, _c in self.settings for c in type(m).__mro__
                   if c not in _FRAMEWORK_CLASSES}
        self.classes = [(c, dict(vars(c))) for c in classes]
        # the same as (names, objects) tuples and each traced module's plain settings as
        # (names, values): compared by C-level maps each step (the check is on every step)
        self._class_members = [(c, tuple(m), tuple(m.values())) for c, m in self.classes]
        self._settings_items = [(tuple(st), tuple(st.values()), _code_key(code))
                                for _, _, st, _, code in self.settings]
        self.held: list[tuple[nn.Module, str, str, tuple | None]] = []
        for module in stage_modules:
            held = [*((n, "_modules", m) for n, m in module.named_modules() if n),
                    *((n, "_parameters", p) for n, p in
                      module.named_parameters(remove_duplicate=False)),
                    *((n, "_buffers", b) for n, b in module.named_buffers(remove_duplicate=False))]
            for path, kind, obj in held:
                if _lookup(model, path, kind) is obj:  # else not the model's name for it
                    form = _form(obj) if isinstance(obj, torch.Tensor) else None
                    self.held.append((module, path, kind, form))
        self._paths = [(*path.rpartition(".")[::2],) for _, path, _, _ in self.held]

    def allocated(self, device: torch.device) -> None:
        """The stages' meta tensors were allocated on ``device`` (a ``vf.deferred_init`` model
        at its pipeline's first use, ``init/allocation.py``): that is their device now."""
        self.held = [(m, path, kind, (f[0], f[1], device, f[3]) if f is not None and
                      f[2].type == "meta" else f) for m, path, kind, f in self.held]

    def check(self) -> None:
        """Raise InputError naming the first edit, if the model was edited since compile."""
        if global_hooks() != self.global_hooks:
            raise InputError(
                "a global module hook (torch.nn.modules.module.register_module_forward_hook "
                "and the like) was added or removed after vf.compile: the graph holds the "
                "modules' code as traced with the hooks there were then. Call vf.compile again")
        for (cls, members), (_, names, objects) in zip(self.classes, self._class_members):
            if not _same_members(vars(cls), names, objects):
                key = next((k for k in {**members, **vars(cls)}
                            if vars(cls).get(k, _GONE) is not members.get(k, _GONE)), "")
                raise InputError(
                    f"{cls.__name__}.{key} was replaced, added or deleted after vf.compile "
                    f"({cls.__name__}'s code was traced into the graph as it was then, so the "
                    "pipeline would keep running the old code). Call vf.compile again")
        for (name, module, settings, hooks, code), (keys, values, code_key) in \
                zip(self.settings, self._settings_items):
            if type(module) is not code[0]:
                raise InputError(
                    f"the class of {type(self.model).__name__ if name else 'the model'}"
                    f"{'.' + name if name else ''} changed from {code[0].__name__} to "
                    f"{type(module).__name__} after vf.compile: the graph holds the code traced "
                    "at compile. Call vf.compile again")
            if not _same_code(module, code_key):
                before, now = dict(code[2]), dict(_code(module)[2])
                key = next((k for k in {**before, **now}
                            if before.get(k, _GONE) is not now.get(k, _GONE)), None)
                if key is None:  # a plain attribute added or deleted (not the code itself)
                    known = before.keys() | settings.keys() | {"training"}
                    key = min(vars(module).keys() ^ known, default="__class__")
                path = f"{name}.{key}" if name else key
                raise InputError(
                    f"{type(self.model).__name__}.{path} was replaced, added or deleted after "
                    "vf.compile (a method or function forward uses, such as forward itself, "
                    "was monkeypatched, or a forward run since then set it, as a Hugging Face "
                    "model marks itself when it installs output hooks): the graph holds the "
                    "model traced at compile, so the pipeline would keep running the old one. "
                    "Call vf.compile again")
            if _hooks(module) != hooks:
                raise InputError(
                    f"a hook was added to or removed from {type(self.model).__name__}"
                    f"{'.' + name if name else ''} after vf.compile: its code was traced "
                    "into the graph with the hooks it had then. Call vf.compile again")
            # the keys are the same (_same_code compared their count and every other one)
            # (a tuple compares by identity first, as a dict does: a NaN setting is no edit)
            if tuple(map(vars(module).get, keys, itertools.repeat(_GONE))) != values:
                now = plain_settings(module)
                key = next(k for k in {**settings, **now}  # identity first (a NaN is no edit)
                           if (settings.get(k, _GONE),) != (now.get(k, _GONE),))
                path = f"{name}.{key}" if name else key
                raise InputError(
                    f"{type(self.model).__name__}.{path} changed from {settings.get(key)!r} to "
                    f"{now.get(key)!r} after vf.compile: the graph holds the value it had when "
                    "traced. Call vf.compile again on the changed model")
        for (module, path, kind, form), (parent, last) in zip(self.held, self._paths):
            now = _lookup_in(self.model, parent, last, kind)
            if now is not _lookup_in(module, parent, last, kind):
                what = {"_modules": "submodule", "_parameters": "parameter",
                        "_buffers": "buffer"}[kind]
                raise InputError(
                    f"{type(self.model).__name__}.{path} is not the {what} this pipeline was "
                    "compiled with (it was replaced or reassigned after vf.compile): the "
                    "stages would run the old one. Call vf.compile again on the edited model "
                    "(and make the optimizer from the new pipe.parameters())")
            if kind == "_parameters" and now.requires_grad and not frozen_ok(form):
                raise InputError(
                    f"{type(self.model).__name__}.{path} requires grad now but was frozen "
                    "(requires_grad=False) at vf.compile: the plan sends it no gradient, so it "
                    "would silently not train. Call vf.compile again after unfreezing (and make "
                    "the optimizer from the new pipe.parameters())")
            if form is not None and _form(now)[:3] != form[:3]:
                raise InputError(
                    f"{type(self.model).__name__}.{path} changed from (shape, dtype, device) "
                    f"{form[:3]} at compile to {_form(now)[:3]} (model.to()/.double()/.half() or a "
                    "resize after vf.compile): call vf.compile again on the changed model")


def traced_modules(gm: fx.GraphModule) -> set[str]:
    """The paths of the modules whose forward was traced into ``gm`` (the root, and every
    module in a node's ``nn_module_stack``), without those it calls (``call_module``)."""
    paths = {""}
    for node in gm.graph.nodes:
        for entry in (node.meta.get("nn_module_stack") or {}).values():
            path = str(entry[0]) if isinstance(entry, tuple) and entry else ""
            paths.add(path.replace("L['self'].", "").replace("L__self__.", ""))
    return paths - {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}


_PLAIN = (bool, int, float, str, type(None))


def global_hooks() -> tuple:
    """The ids of the hooks registered for every module (``torch.nn.modules.module.
    register_module_forward_hook`` and its siblings), forward pre-hooks, forward hooks,
    backward pre-hooks, backward hooks."""
    module = torch.nn.modules.module
    return tuple(tuple(d) for d in (module._global_forward_pre_hooks,
                                    module._global_forward_hooks,
                                    module._global_backward_pre_hooks,
                                    module._global_backward_hooks))


def _hooks(module: nn.Module) -> tuple:
    """The ids of a module's hooks: a traced module's hooks ran while tracing, so they are in
    the graph as they were (a module the graph calls runs its hooks itself at each step)."""
    return tuple(tuple(d) for d in (module._forward_hooks, module._forward_pre_hooks,
                                    module._backward_hooks, module._backward_pre_hooks))


# nn.Module's own methods (a patched __call__ would change the stages too) and what every
# class has: their members are never traced code of the model
_FRAMEWORK_CLASSES = (object, nn.Module, fx.GraphModule)


def _code(module: nn.Module) -> tuple:
    """What a traced module's forward runs besides its plain settings, tensors and hooks: its
    class and the other objects in its ``__dict__`` (an instance ``forward = new_fn``, an
    ``act = F.gelu``, a ``functools.partial``), compared by identity (:func:`_same_code`)."""
    d = vars(module)
    return type(module), len(d), tuple((k, v) for k, v in d.items() if not _plain(v))


def _code_key(code: tuple) -> tuple:
    """``code`` (a :func:`_code`) as (class, attribute count, names, objects): what
    :func:`_same_code` compares, cut once."""
    return code[0], code[1], tuple(k for k, _ in code[2]), tuple(v for _, v in code[2])


def _same_code(module: nn.Module, key: tuple) -> bool:
    """Whether ``_code(module)`` would equal the code ``key`` was made of (:func:`_code_key`),
    without building it (every step asks): a key added or deleted changes the length, a plain
    one the plain settings."""
    d = vars(module)
    return type(module) is key[0] and len(d) == key[1] and \
        all(map(operator.is_, map(d.get, key[2], itertools.repeat(_GONE)), key[3]))


def _same_members(now: Mapping[str, Any], names: tuple[str, ...], objects: tuple) -> bool:
    """Whether ``now`` (a class's ``vars``) holds exactly ``names`` bound to ``objects``."""
    return len(now) == len(names) and \
        all(map(operator.is_, map(now.get, names, itertools.repeat(_GONE)), objects))


def plain_settings(module: nn.Module) -> dict[str, Any]:
    """A module's plain attributes (numbers, strings, tuples of them), but its mode."""
    return {k: v for k, v in vars(module).items() if k != "training" and _plain(v)}


def _plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _lookup(root: nn.Module, path: str, kind: str) -> Any:
    """The object at ``path`` (a submodule, parameter or buffer by ``kind``), or None."""
    parent, _, last = path.rpartition(".")
    return _lookup_in(root, parent, last, kind)


def _lookup_in(root: nn.Module, parent: str, last: str, kind: str) -> Any:
    """``_lookup`` of ``parent + "." + last``, the path already cut (every step looks up)."""
    current: Any = root
    if parent:
        for part in parent.split("."):
            current = current._modules.get(part) if isinstance(current, nn.Module) else None
    return getattr(current, kind).get(last) if isinstance(current, nn.Module) else None


def _form(t: torch.Tensor) -> tuple:
    """(shape, dtype, device, requires_grad)."""
    return tuple(t.shape), t.dtype, t.device, t.requires_grad


def frozen_ok(form: tuple | None) -> bool:
    """Whether the tensor required grad at compile (freezing it later is followed: its
    gradient stays None, as in eager)."""
    return form is None or form[3]
