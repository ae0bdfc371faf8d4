"""What a checkpoint holds besides the tensors, and the check that it fits the model.

Keys: ``model/<fqn>`` (every parameter and persistent buffer), ``obj/meta`` (rank 0: loss scale,
the RNG state step seeds are drawn from, the user's ``extra``), and the optimizer's entries
(``optimizer_state.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CheckpointError
from ..planner.plan import Plan
from ..runtime.model_state import StateLayout

MODEL = "model/"
META = "obj/meta"


def rng_state() -> dict[str, Any]:
    """The generators step seeds (dropout) are drawn from: rank 0's, restored on every rank."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available() and \
            len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def class_name(optimizer: torch.optim.Optimizer) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def layout_summary(plan: Plan) -> dict[str, Any]:
    return {"stages": plan.stages, "data_parallel": plan.data_parallel,
            "micro_batch_size": plan.micro_batch_size, "schedule": plan.schedule.name}


def check_same_model(layout: StateLayout, metadata: dict[str, Any], path: str) -> None:
    """Refuse a checkpoint of another model, naming what differs."""
    saved = {k[len(MODEL):]: tuple(v.size) for k, v in metadata.items() if k.startswith(MODEL)}
    missing = [n for n in layout.names if n not in saved]
    unexpected = [n for n in saved if n not in layout.shapes]
    shapes = [f"{n} {saved[n]} saved, {layout.shapes[n]} now" for n in layout.names
              if n in saved and saved[n] != layout.shapes[n]]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {few(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)}: {few(unexpected)}")
        if shapes:
            parts.append(f"shape mismatches: {few(shapes)}")
        raise CheckpointError(f"{path} is a checkpoint of another model ({'; '.join(parts)})")


_SCALARS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device,
            torch.Size)
ALLOWED = ("None, bool, int, float, complex, str, bytes, torch.Tensor, torch.dtype, "
           "torch.device, torch.Size, and lists, tuples, sets and dicts (keys str or int) "
           "of these")


def check_plain(extra: dict[str, Any], what: str = "extra") -> None:
    """``extra`` (or another state, named ``what``) holds only data a weights-only load
    restores (so a checkpoint never runs code): else :class:`CheckpointError` naming the key
    and the type, and what is allowed."""
    stack: list[tuple[str, Any]] = [(f"{what}[{k!r}]", v) for k, v in extra.items()]
    if not all(isinstance(k, str | int) for k in extra):
        stack.insert(0, (f"{what}'s keys",
                         next(k for k in extra if not isinstance(k, str | int))))
    while stack:
        where, value = stack.pop()
        if type(value) in _SCALARS or type(value) in (torch.Tensor, torch.nn.Parameter):
            continue
        if type(value) in (list, tuple, set, frozenset):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))
            continue
        if type(value) is dict:
            for k, v in value.items():
                if not isinstance(k, str | int):
                    stack.append((f"a key of {where}", k))
                stack.append((f"{where}[{k!r}]", v))
            continue
        kind = type(value)
        hint = ""
        if kind.__module__ == "numpy":
            hint = " (convert it: .item() for a numpy scalar, torch.from_numpy for an array)"
        raise CheckpointError(
            f"{what} must hold plain data, but {where} is a {kind.__module__}."
            f"{kind.__qualname__}{hint}. Allowed: {ALLOWED} (so that loading a checkpoint "
            "never runs code)")


def few(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
