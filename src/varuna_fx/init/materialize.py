"""Allocate and initialise the tensors of a ``deferred_init`` model: all, or one stage's.

Materialising makes a new tensor object per recorded meta tensor (a meta ``Parameter``'s data
cannot be swapped for a CPU tensor's, and ``torch.utils.swap_tensors`` refuses tensors that
torch.export holds weak references to) and puts it wherever the old one was: in the model and
in every other module tree given (``roots``: the captured graph, the stage modules). Tied
tensors are one object, so they stay one. A tensor ``vf.skip_init`` skipped is allocated and
marked (``skip.py``): a step before a checkpoint fills it raises, as for any skipped tensor.

Limits: a ``copy.deepcopy`` of a deferred model is not recorded (refused when materialised);
random values are the same on every layout of one device type (a CUDA generator draws other
numbers than a CPU one); a torch.export stage's ``.code`` text still reads ``device=meta`` where
the graph was retargeted; tensors computed from more than 1 MiB of unrecorded CPU data are
refused, not carried. A one-process pipeline materialises a deferred model whole when it is
first used (``init/allocation.py``; compile only checks, with :func:`check_replayable`, that it
could); ``runtime/distributed.py`` materialises only ``layout.held_names(...)`` of its stage
before ``release_unheld`` and refuses a meta model without records (``refuse_plain_meta``).
A pipeline compiled before another one materialised the same model finds the new tensors by
:func:`successor`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.fx as fx
from torch import nn

from ..errors import UninitializedError
from .record import StorageRecord, lookup
from .replay import Replayer, never_written, storage_names
from .skip import mark


def is_deferred(model: nn.Module) -> bool:
    """Whether any of the model's tensors was built under ``vf.deferred_init`` and is still
    on the meta device."""
    return any(lookup(t) is not None for t in _tensors(model))


def meta_without_record(model: nn.Module) -> list[str]:
    """Names of meta tensors of the model that ``deferred_init`` did not record."""
    return [n for n, t in _named(model) if t.is_meta and lookup(t) is None]


def materialize(model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """Allocate and initialise every tensor of a model built under ``vf.deferred_init``, in
    place, on ``device`` (default CPU), with the values ``vf.compile`` gives each stage on
    any layout; returns the model. Tensors already real stay as they are."""
    materialize_tensors(model, None, torch.device(device or "cpu"))
    return model


def materialize_tensors(model: nn.Module, names: Iterable[str] | None, device: torch.device,
                        roots: Sequence[nn.Module] = ()) -> dict[str, torch.Tensor]:
    """Materialise the model's meta tensors whose canonical FQN is in ``names`` (all: None)
    on ``device``, replacing them in ``model`` and every module of ``roots``. Returns the new
    tensors by canonical FQN. Raises :class:`UninitializedError` naming a tensor that cannot
    be replayed (not recorded, or built from data too big to carry)."""
    todo = _Todo(model, names, device)
    made: dict[int, torch.Tensor] = {}
    by_name: dict[str, torch.Tensor] = {}
    for t, name, rec, replayer in todo.items():
        try:
            real = replayer.tensor(t)
        except UninitializedError as exc:
            raise UninitializedError(f"{name} cannot be initialised exactly: {exc}") from None
        if rec.skipped:
            mark(real)  # vf.skip_init skipped its initialiser: a load must fill it
        new = nn.Parameter(real, requires_grad=t.requires_grad) \
            if isinstance(t, nn.Parameter) else real.requires_grad_(t.requires_grad)
        made[id(t)] = new
        by_name[name] = new
        replayer.release_temporaries(todo.storages)
    for old_id, new in made.items():  # a pipeline compiled earlier finds them (successor)
        _SUCCESSORS[old_id] = new
        weakref.finalize(todo.objects[old_id], _SUCCESSORS.pop, old_id, None)
    replace_tensors([model, *roots], made)
    retarget_devices(roots, device)
    return by_name


def check_replayable(model: nn.Module, names: Iterable[str] | None = None) -> None:
    """Raise the :class:`UninitializedError` :func:`materialize_tensors` would raise for the
    records of these tensors (all: None), without allocating anything: ``vf.compile`` of a
    deferred model refuses at once what its pipeline could never allocate later."""
    todo = _Todo(model, names, torch.device("cpu"))
    for _, name, rec, replayer in todo.items():
        try:
            replayer.check(rec.key, len(rec.steps))
        except UninitializedError as exc:
            raise UninitializedError(f"{name} cannot be initialised exactly: {exc}") from None


def deferred_bytes(model: nn.Module, names: Iterable[str] | None = None) -> int:
    """Bytes that materialising these tensors (all: None) allocates: each meta storage the
    recorder made, once (tied tensors and views share one)."""
    wanted = None if names is None else set(names)
    sizes: dict[int, int] = {}
    seen: set[int] = set()
    for name, t in _named(model):
        if id(t) in seen:
            continue
        seen.add(id(t))
        if t.is_meta and (wanted is None or name in wanted) and lookup(t) is not None:
            storage = t.untyped_storage()
            sizes[storage._cdata] = storage.nbytes()
    return sum(sizes.values())


def successor(t: torch.Tensor) -> torch.Tensor | None:
    """The real tensor that materialising the meta tensor ``t`` made (while ``t`` lives), or
    None: a pipeline compiled before another one materialised the model finds its tensors."""
    return _SUCCESSORS.get(id(t)) if t.is_meta else None


# id(meta tensor) -> the tensor materialising it made; an entry goes when its meta tensor does
_SUCCESSORS: dict[int, torch.Tensor] = {}


class _Todo:
    """The model's meta tensors named by ``names`` (all: None), each with its canonical FQN,
    record and the replayer of its recording on ``device``."""

    def __init__(self, model: nn.Module, names: Iterable[str] | None,
                 device: torch.device) -> None:
        wanted = None if names is None else set(names)
        self.canonical: dict[int, str] = {}
        for name, t in _named(model):
            self.canonical.setdefault(id(t), name)
        self.objects = {id(t): t for _, t in _named(model)}
        self.todo = [t for i, t in self.objects.items() if t.is_meta and
                     (wanted is None or self.canonical[i] in wanted)]
        self.storages = {o.untyped_storage()._cdata for o in self.todo}
        self.device = device

    def items(self) -> Iterator[tuple[torch.Tensor, str, StorageRecord, Replayer]]:
        replayers: dict[int, Replayer] = {}
        for t in self.todo:
            name = self.canonical[id(t)]
            found = lookup(t)
            if found is None:
                raise UninitializedError(
                    f"{name} is on the meta device but was not built under "
                    "vf.deferred_init, so nothing says what it holds: build the model inside "
                    "`with vf.deferred_init(seed=...)`, or build it with real tensors")
            recording, rec = found
            if never_written(rec):
                raise UninitializedError(
                    f"{name} was allocated uninitialised (torch.empty) and nothing "
                    "the recorder saw wrote it while the model was built, so it would hold "
                    "garbage: initialise it in the model's code (torch.nn.init, Tensor.normal_, "
                    "fill_...), or, if a checkpoint fills it, build the model under vf.skip_init "
                    "as well")
            replayer = replayers.get(id(recording))
            if replayer is None:
                if recording.names is None:  # named once, while every tensor is still on
                    model_names: dict[int, str] = {}  # meta: a later call (another stage)
                    for i, o in self.objects.items():  # sees the same names
                        if o.is_meta:
                            model_names.setdefault(o.untyped_storage()._cdata,
                                                   self.canonical[i])
                    recording.names = storage_names(recording, model_names)
                replayer = replayers[id(recording)] = Replayer(recording, recording.names,
                                                               self.device)
            yield t, name, rec, replayer


def replace_tensors(roots: Sequence[nn.Module], made: dict[int, torch.Tensor]) -> None:
    """Put ``made[id(old)]`` wherever a module of ``roots`` holds ``old`` as a parameter,
    buffer or plain tensor attribute."""
    if not made:
        return
    seen: set[int] = set()
    for root in roots:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for table in (module._parameters, module._buffers):
                for key, value in table.items():
                    if value is not None and id(value) in made:
                        table[key] = made[id(value)]
            for key, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and id(value) in made:
                    setattr(module, key, made[id(value)])


def _named(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False)]


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    return [t for _, t in _named(model)]


def retarget_devices(modules: Sequence[nn.Module], device: torch.device) -> None:
    """Graphs captured from a meta model may name the meta device (torch.export records
    ``labels.to(logits.device)`` as ``to(..., device=meta)``): point them at ``device``,
    where the tensors now are."""
    def fix(value: object) -> object:
        if isinstance(value, torch.device) and value.type == "meta":
            return device
        return value

    for root in modules:
        for gm in root.modules():
            if not isinstance(gm, fx.GraphModule):
                continue
            changed = False
            for node in gm.graph.nodes:
                args = fx.node.map_aggregate(node.args, fix)
                kwargs = fx.node.map_aggregate(node.kwargs, fix)
                if args != node.args or kwargs != node.kwargs:
                    node.args, node.kwargs, changed = args, kwargs, True
            if changed:
                gm.recompile()
