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
refused, not carried. ``pipeline.make_pipeline`` materialises a deferred model whole in one
process; ``runtime/distributed.py`` materialises only ``layout.held_names(...)`` of its stage
before ``release_unheld`` and refuses a meta model without records (``refuse_plain_meta``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.fx as fx
from torch import nn

from ..errors import UninitializedError
from .record import lookup
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
    wanted = None if names is None else set(names)
    canonical: dict[int, str] = {}
    for name, t in _named(model):
        canonical.setdefault(id(t), name)
    objects = {id(t): t for _, t in _named(model)}
    todo = [t for i, t in objects.items() if t.is_meta and
            (wanted is None or canonical[i] in wanted)]
    replayers: dict[int, Replayer] = {}
    made: dict[int, torch.Tensor] = {}
    by_name: dict[str, torch.Tensor] = {}
    for t in todo:
        found = lookup(t)
        if found is None:
            raise UninitializedError(
                f"{canonical[id(t)]} is on the meta device but was not built under "
                "vf.deferred_init, so nothing says what it holds: build the model inside "
                "`with vf.deferred_init(seed=...)`, or build it with real tensors")
        recording, rec = found
        if never_written(rec):
            raise UninitializedError(
                f"{canonical[id(t)]} was allocated uninitialised (torch.empty) and nothing "
                "the recorder saw wrote it while the model was built, so it would hold "
                "garbage: initialise it in the model's code (torch.nn.init, Tensor.normal_, "
                "fill_...), or, if a checkpoint fills it, build the model under vf.skip_init "
                "as well")
        replayer = replayers.get(id(recording))
        if replayer is None:
            if recording.names is None:  # named once, while every tensor is still on meta:
                model_names: dict[int, str] = {}  # a later call (another stage) sees the same
                for i, o in objects.items():
                    if o.is_meta:
                        model_names.setdefault(o.untyped_storage()._cdata, canonical[i])
                recording.names = storage_names(recording, model_names)
            replayer = replayers[id(recording)] = Replayer(recording, recording.names, device)
        try:
            real = replayer.tensor(t)
        except UninitializedError as exc:
            raise UninitializedError(
                f"{canonical[id(t)]} cannot be initialised exactly: {exc}") from None
        if rec.skipped:
            mark(real)  # vf.skip_init skipped its initialiser: a load must fill it
        new = nn.Parameter(real, requires_grad=t.requires_grad) \
            if isinstance(t, nn.Parameter) else real.requires_grad_(t.requires_grad)
        made[id(t)] = new
        by_name[canonical[id(t)]] = new
        replayer.release_temporaries({o.untyped_storage()._cdata for o in todo})
    replace_tensors([model, *roots], made)
    retarget_devices(roots, device)
    return by_name


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
