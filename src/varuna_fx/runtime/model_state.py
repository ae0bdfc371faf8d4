"""Which parameters and buffers make up the model's state, and which ranks hold them.

A stage holds exactly the tensors its code reads. Tensors that forward never reads (an auxiliary
head, a version buffer) belong to no stage, yet they are part of the model's state: stage 0 of
every replica keeps them (in one process: the process), so ``pipe.state_dict()`` and checkpoints
never lose them. They get no gradient, as in eager, so the gradient sync leaves them alone.

The full shapes and dtypes are recorded before a distributed rank empties what it does not hold:
checkpoint loading compares them with a checkpoint's to name what differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..codegen.stage_module import Stage
from ..errors import InputError


@dataclass
class StateLayout:
    names: list[str]  # canonical FQNs of every parameter and persistent buffer, model order
    parameters: set[str]  # those that are parameters
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    unread: set[str]  # read by no stage: held by stage 0 of each replica
    aliases: dict[str, str]  # every FQN (tied ones under each name) -> canonical FQN

    @classmethod
    def of(cls, model: nn.Module, canonical: dict[str, str], stages: list[Stage]) -> StateLayout:
        persistent = set(model.state_dict().keys())
        tensors: dict[str, torch.Tensor] = {}
        params: set[str] = set()
        for name, t in model.named_parameters(remove_duplicate=False):
            tensors.setdefault(canonical[name], t)
            params.add(canonical[name])
        for name, t in model.named_buffers(remove_duplicate=False):
            if name in persistent:
                tensors.setdefault(canonical[name], t)
        held = {n for s in stages for n in [*s.parameter_names, *s.spec.buffer_names]}
        # a tensor known under several names is state if any of them is persistent
        names = [n for n in dict.fromkeys(canonical.values()) if n in tensors]
        aliases = {a: c for a, c in canonical.items() if c in tensors}
        return cls(names=names, parameters=params,
                   shapes={n: tuple(tensors[n].shape) for n in names},
                   dtypes={n: tensors[n].dtype for n in names},
                   unread={n for n in names if n not in held}, aliases=aliases)

    def held_names(self, canonical: dict[str, str], stages: list[Stage],
                   local: list[int]) -> list[str]:
        """Canonical FQNs of the parameters and buffers the processes running the ``local``
        stages hold (model order): their stages' tensors, and on stage 0 the unread ones."""
        held = {n for s in local
                for n in [*stages[s].parameter_names, *stages[s].spec.buffer_names]}
        if 0 in local:
            held |= self.unread
        return [n for n in dict.fromkeys(canonical.values()) if n in held]


def unread_tensors(model: nn.Module, layout: StateLayout) -> list[torch.Tensor]:
    """The parameter/buffer objects no stage reads (stage 0 keeps them)."""
    found: dict[str, torch.Tensor] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        canon = layout.aliases.get(name)
        if canon in layout.unread:
            found.setdefault(canon, t)
    return list(found.values())


def check_state_dict(state: dict[str, torch.Tensor], layout: StateLayout, held: list[str],
                     strict: bool) -> dict[str, torch.Tensor]:
    """``state`` -> {held canonical name: tensor}, refusing unknown keys (strict), missing held
    ones (strict) and shape mismatches (always: copying would broadcast a (1, 16) tensor into a
    (16, 16) weight)."""
    unknown = [k for k in state if k not in layout.aliases]
    if strict and unknown:
        raise InputError(
            f"state dict has {len(unknown)} keys the model does not have: {_few(unknown)}; "
            "pass strict=False to ignore them"
        )
    by_canonical = {layout.aliases[k]: v for k, v in state.items() if k in layout.aliases}
    missing = [n for n in held if n not in by_canonical]
    if strict and missing:
        raise InputError(
            f"state dict lacks {len(missing)} of the model's entries: {_few(missing)}; pass "
            "strict=False to load a part"
        )
    wrong = [f"{n}: {tuple(by_canonical[n].shape)} given, {layout.shapes[n]} in the model"
             for n in held if n in by_canonical
             and tuple(by_canonical[n].shape) != layout.shapes[n]]
    if wrong:
        raise InputError(f"state dict shapes differ from the model's: {_few(wrong)}")
    return {n: by_canonical[n] for n in held if n in by_canonical}


def _few(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
