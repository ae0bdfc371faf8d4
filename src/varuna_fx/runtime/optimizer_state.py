"""Optimizer state keyed by parameter FQN, so it loads under any layout.

``torch.optim.Optimizer.state_dict()`` names parameters by their position in the optimizer,
which depends on the stage a rank runs. Here every parameter's state is stored under its
canonical FQN: tensors as ``optim/<fqn>/<key>`` (written by DCP as tensors), and everything
else about it -- non-tensor state and the hyperparameters of its param group (lr, betas, weight
decay, ...) -- as one small object ``obj/optim/<fqn>``. Loading rebuilds a positional state dict
for whatever parameters the new optimizer holds and hands it to ``optimizer.load_state_dict``,
so every optimizer class's own checks and casts apply.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from ..errors import CheckpointError

TENSOR_PREFIX = "optim/"
OBJECT_PREFIX = "obj/optim/"


def encode(obj: Any) -> torch.Tensor:
    """Plain data (numbers, strings, lists, dicts, tensors) -> a uint8 tensor DCP can store."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def decode(data: torch.Tensor) -> Any:
    # weights_only: a checkpoint can carry data, never code
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)


def parameter_fqns(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[str]:
    """The FQN of every parameter in ``optimizer``, in its state-dict index order."""
    fqns, foreign = [], 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in names:
                fqns.append(names[id(p)])
            else:
                foreign += 1
    if foreign:
        raise CheckpointError(
            f"the optimizer holds {foreign} tensors that are not parameters of this pipeline; "
            "build it from pipe.parameters()"
        )
    return fqns


def optimizer_entries(optimizer: torch.optim.Optimizer,
                      names: dict[int, str]) -> dict[str, torch.Tensor]:
    """``optimizer``'s state as DCP entries keyed by FQN."""
    fqns = parameter_fqns(optimizer, names)
    state = optimizer.state_dict()
    entries: dict[str, torch.Tensor] = {}
    index = 0
    for group in state["param_groups"]:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for i in group["params"]:
            fqn = fqns[index]
            index += 1
            other = {}
            for key, value in state["state"].get(i, {}).items():
                if isinstance(value, torch.Tensor):
                    entries[f"{TENSOR_PREFIX}{fqn}/{key}"] = value.detach()
                else:
                    other[key] = value
            entries[f"{OBJECT_PREFIX}{fqn}"] = encode({"group": hyper, "state": other})
    return entries


def wanted_keys(fqns: list[str], available: list[str]) -> list[str]:
    """The checkpoint keys holding these parameters' optimizer state."""
    mine = {f"{TENSOR_PREFIX}{f}/" for f in fqns}
    wanted = [k for k in available if k.startswith(TENSOR_PREFIX)
              and k[:k.rindex("/") + 1] in mine]
    missing = [f for f in fqns if f"{OBJECT_PREFIX}{f}" not in available]
    if missing:
        raise CheckpointError(
            f"the checkpoint has no optimizer state for {len(missing)} parameters the optimizer "
            f"holds, e.g. {missing[:5]}: it was saved with an optimizer over other parameters"
        )
    return wanted + [f"{OBJECT_PREFIX}{f}" for f in fqns]


def restore_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str],
                      loaded: dict[str, torch.Tensor]) -> None:
    """Rebuild ``optimizer``'s positional state dict from the FQN-keyed ``loaded`` entries."""
    fqns = parameter_fqns(optimizer, names)
    objects = {f: decode(loaded[f"{OBJECT_PREFIX}{f}"]) for f in fqns}
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in loaded.items():
        if key.startswith(TENSOR_PREFIX):
            fqn, name = key[len(TENSOR_PREFIX):].rsplit("/", 1)
            tensors.setdefault(fqn, {})[name] = value
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group in optimizer.param_groups:
        indices = list(range(index, index + len(group["params"])))
        members = fqns[index:index + len(indices)]
        index += len(indices)
        saved = [objects[f]["group"] for f in members]
        if any(not _same(s, saved[0]) for s in saved[1:]):
            raise CheckpointError(
                f"parameters {members[:5]} share a param group now but had different "
                "hyperparameters when saved: build the optimizer's param groups as they were"
            )
        hyper = saved[0] if saved else {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": indices})
        for i, fqn in zip(indices, members):
            entry = {**objects[fqn]["state"], **tensors.get(fqn, {})}
            if entry:
                state[i] = entry
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                    and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True
