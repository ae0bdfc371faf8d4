"""Objects with ``state_dict``/``load_state_dict`` in a checkpoint: the data loader's position
(``data=``), an LR scheduler (``scheduler=``) and any others (``stateful={"ema": ema}``).

Each object's ``state_dict()`` is checked to be plain data (``contents.check_plain``), stored
as one ``obj/state/<name>`` entry (a uint8 tensor, decoded with ``weights_only=True``, as
``extra`` is) written by rank 0, and restored on every rank under any layout. So what may be
saved this way is state every rank holds alike -- a scheduler, the loader's global position,
a step counter, an EMA of a scalar -- and the save checks that the ranks' states agree
(a digest per object rides on the save's first agreement) instead of keeping rank 0's silently.
State that differs per rank (an EMA of this rank's parameters) is refused with that reason.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CheckpointError
from .contents import check_plain, few
from .optimizer_state import decode, encode

PREFIX = "obj/state/"


def label(name: str) -> str:
    """How messages name an object: ``data=``, ``scheduler=``, ``stateful['ema']``."""
    if name.startswith("stateful."):
        return f"stateful[{name[len('stateful.'):]!r}]"
    return f"{name}="


def collect(data: Any = None, scheduler: Any = None,
            stateful: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The objects to save or load, by entry name; each must have both methods."""
    objects: dict[str, Any] = {}
    if data is not None:
        objects["data"] = data
    if scheduler is not None:
        objects["scheduler"] = scheduler
    if stateful is not None:
        if not isinstance(stateful, Mapping):
            raise CheckpointError(
                f"stateful must map names to objects with state_dict/load_state_dict "
                f"(e.g. stateful={{'ema': ema}}), got {type(stateful).__name__}")
        for name, obj in stateful.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise CheckpointError(f"stateful's names must be identifiers (they name "
                                      f"checkpoint entries), got {name!r}")
            objects[f"stateful.{name}"] = obj
    for name, obj in objects.items():
        if not all(callable(getattr(obj, m, None)) for m in ("state_dict", "load_state_dict")):
            raise CheckpointError(
                f"{label(name)} got a {type(obj).__name__}, which lacks state_dict() and "
                "load_state_dict(): pass an object with both (an LR scheduler, the loader "
                "pipe.data_loader returns), or put plain values in extra=")
    return objects


def entries(objects: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(the checkpoint entries of ``objects``, a digest of each for :func:`check_same`)."""
    saved: dict[str, torch.Tensor] = {}
    digests: dict[str, str] = {}
    for name, obj in objects.items():
        state = obj.state_dict()
        if not isinstance(state, dict):
            raise CheckpointError(f"{label(name)}'s state_dict() returned a "
                                  f"{type(state).__name__}, not a dict")
        check_plain(state, f"{label(name)}'s state_dict()")
        data = encode(state)
        try:
            decode(data)
        except Exception as exc:
            raise CheckpointError(f"{label(name)}'s state_dict() does not load back without "
                                  f"running code: {str(exc).splitlines()[0]}") from exc
        saved[PREFIX + name] = data
        digests[name] = hashlib.sha256(data.numpy().tobytes()).hexdigest()
    return saved, digests


def check_same(per_rank: list[Any]) -> None:
    """Every rank's digests (``agreement.agree``'s values) must be equal: else every rank
    raises, naming the objects whose state differs."""
    mine = [d or {} for d in per_rank]
    differ = sorted({n for d in mine for n in d if any(o.get(n) != d[n] for o in mine)})
    if differ:
        raise CheckpointError(
            f"the state of {', '.join(label(n) for n in differ)} differs between the ranks: "
            "a checkpoint keeps one copy, restored on every rank under any layout, so only "
            "state every rank holds alike can be saved this way (a scheduler, the loader's "
            "position, a counter). Keep per-rank state (e.g. an EMA of this rank's "
            "parameters) out of stateful=, or make it the same on every rank")


def wanted(objects: dict[str, Any], available: list[str], path: str) -> list[str]:
    """The entries to read for ``objects``; a warning names saved states nobody asked for."""
    keys = [PREFIX + n for n in objects]
    missing = [label(n) for n in objects if PREFIX + n not in available]
    if missing:
        raise CheckpointError(
            f"{path} holds no saved state for {few(missing)}: it was saved without it. Load "
            "without that argument (the object keeps its current state), or from a "
            "checkpoint saved with it")
    unused = [label(k[len(PREFIX):]) for k in available
              if k.startswith(PREFIX) and k not in keys]
    if unused:
        warnings.warn(f"{path} holds the state of {few(unused)}, which load_checkpoint was not "
                      "given: those objects keep their current state (a data loader starts "
                      "from the beginning)", stacklevel=5)
    return keys


def restore(objects: dict[str, Any], loaded: dict[str, torch.Tensor], path: str) -> None:
    """Decode every object's state (refusing what is not a dict), then load each. Runs after
    the model and optimizer are loaded; an error says so."""
    done = f"{path}: the model and optimizer were loaded, but"
    states = {}
    for name in objects:
        try:
            state = decode(loaded[PREFIX + name])
        except Exception as exc:
            raise CheckpointError(f"{done} the saved state of {label(name)} cannot be read "
                                  f"as plain data ({str(exc).splitlines()[0]}): the "
                                  "checkpoint was damaged or tampered with") from exc
        if not isinstance(state, dict):
            raise CheckpointError(f"{done} the saved state of {label(name)} is a "
                                  f"{type(state).__name__}, not a dict: the checkpoint was "
                                  "tampered with")
        states[name] = state
    for name, obj in objects.items():
        try:
            obj.load_state_dict(states[name])
        except Exception as exc:
            raise CheckpointError(f"{done} {label(name)} refused its saved state: "
                                  f"{exc}") from exc
