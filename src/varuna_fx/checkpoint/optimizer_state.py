"""Optimizer state keyed by parameter FQN, so it loads under any layout.

``torch.optim.Optimizer.state_dict()`` names parameters by their position in the optimizer,
which depends on the stage a rank runs. Here every parameter's state is stored under its
canonical FQN, as DCP entries:

* ``optim/<fqn>/<key>``: its tensor state (``exp_avg``, ``step``, ...);
* ``optim_group/<fqn>``: the id of its param group's hyperparameters (an int64 tensor), and
  ``obj/optim_group/<id>``: those hyperparameters (lr, betas, weight decay, ...), once per
  distinct group -- a few small objects, not one per parameter;
* ``obj/optim/<fqn>``: non-tensor state, for the optimizers that keep any.

Loading rebuilds a positional state dict for whatever parameters the new optimizer holds and
hands it to ``optimizer.load_state_dict``, so every optimizer class's own checks and casts apply.
A sharded (ZeRO-1) optimizer writes each parameter's elementwise state as the chunk it holds
(``sharded_state.py``); either form loads into either kind of optimizer.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

import torch

from ..errors import CheckpointError
from ..runtime.sync.zero import layout_of
from .sharded_state import CHUNK_PREFIX, SavedState, restore_sharded, sharded_entries

TENSOR_PREFIX = "optim/"
GROUP_PREFIX = "optim_group/"
OBJECT_PREFIX = "obj/optim/"
GROUP_OBJECT_PREFIX = "obj/optim_group/"


def encode(obj: Any) -> torch.Tensor:
    """Plain data (numbers, strings, lists, dicts, tensors) -> a uint8 tensor DCP can store."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def decode(data: torch.Tensor) -> Any:
    # weights_only: a checkpoint can carry data, never code
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)


def parameter_fqns(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[str]:
    """The FQN of every parameter in ``optimizer``, in its state-dict index order (a sharded
    optimizer: every parameter its shards cover)."""
    layout = layout_of(optimizer)
    if layout is not None:
        return layout.names()
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
    layout = layout_of(optimizer)
    if layout is not None:
        return sharded_entries(optimizer, layout, _group_id, encode, PREFIXES)
    fqns = parameter_fqns(optimizer, names)
    state = optimizer.state_dict()
    entries: dict[str, torch.Tensor] = {}
    index = 0
    for group in state["param_groups"]:
        hyper = {k: v for k, v in group.items() if k != "params"}
        group_id = _group_id(hyper)
        entries[f"{GROUP_OBJECT_PREFIX}{group_id}"] = encode(hyper)
        for i in group["params"]:
            fqn = fqns[index]
            index += 1
            entries[f"{GROUP_PREFIX}{fqn}"] = torch.tensor([group_id], dtype=torch.int64)
            other = {}
            for key, value in state["state"].get(i, {}).items():
                if isinstance(value, torch.Tensor):
                    entries[f"{TENSOR_PREFIX}{fqn}/{key}"] = value.detach()
                else:
                    other[key] = value
            if other:
                entries[f"{OBJECT_PREFIX}{fqn}"] = encode(other)
    return entries


def wanted_keys(fqns: list[str], available: list[str]) -> list[str]:
    """The checkpoint keys holding these parameters' optimizer state."""
    mine = {f"{TENSOR_PREFIX}{f}/" for f in fqns}
    chunks = {f"{CHUNK_PREFIX}{f}/" for f in fqns}
    missing = [f for f in fqns if f"{GROUP_PREFIX}{f}" not in available]
    if missing:
        raise CheckpointError(
            f"the checkpoint has no optimizer state for {len(missing)} parameters the optimizer "
            f"holds, e.g. {missing[:5]}: it was saved with an optimizer over other parameters"
        )
    objects = {f"{OBJECT_PREFIX}{f}" for f in fqns} | {f"{GROUP_PREFIX}{f}" for f in fqns}
    return [k for k in available
            if (k.startswith(TENSOR_PREFIX) and k[:k.rindex("/") + 1] in mine)
            or (k.startswith(CHUNK_PREFIX) and k[:k.rindex("/", 0, k.rindex("/")) + 1] in chunks)
            or k in objects or k.startswith(GROUP_OBJECT_PREFIX)]


def restore_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str],
                      loaded: dict[str, torch.Tensor]) -> None:
    """Rebuild ``optimizer``'s positional state dict from the FQN-keyed ``loaded`` entries."""
    fqns = parameter_fqns(optimizer, names)
    hypers = {int(k[len(GROUP_OBJECT_PREFIX):]): decode(v) for k, v in loaded.items()
              if k.startswith(GROUP_OBJECT_PREFIX)}
    saved = SavedState(loaded, TENSOR_PREFIX, OBJECT_PREFIX, decode)

    owner: dict[int, int] = {}  # saved group id -> the optimizer's group now
    asked: list[int] = []  # the groups group_hyper was asked for so far

    def group_hyper(members: list[str], group: dict[str, Any]) -> dict[str, Any]:
        """The saved hyperparameters of the optimizer's next group (called once per group,
        in order), holding the parameters ``members``."""
        now = len(asked)
        asked.append(now)
        ids = {int(loaded[f"{GROUP_PREFIX}{f}"][0]) for f in members}
        if len(ids) > 1:
            raise CheckpointError(
                f"parameters {members[:5]} share a param group now but had different "
                "hyperparameters when saved: build the optimizer's param groups as they were"
            )
        if ids and owner.setdefault(next(iter(ids)), now) != now:
            raise CheckpointError(  # as torch's load_state_dict refuses other group counts
                f"param groups {owner[next(iter(ids))]} and {now} of the optimizer "
                "were one param group when saved: the checkpoint's hyperparameters would "
                "overwrite both groups' (lr, weight decay, ...). Build the optimizer's param "
                "groups as they were when saved, and change them after loading")
        return hypers[ids.pop()] if ids else {k: v for k, v in group.items() if k != "params"}

    layout = layout_of(optimizer)
    if layout is not None:
        restore_sharded(optimizer, layout, saved, group_hyper)
        return
    shapes = {n: p.shape for group in optimizer.param_groups for p in group["params"]
              for n in [names[id(p)]]}
    tensors = {fqn: saved.whole_state(fqn, shapes[fqn]) for fqn in fqns}
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group in optimizer.param_groups:
        indices = list(range(index, index + len(group["params"])))
        members = fqns[index:index + len(indices)]
        index += len(indices)
        groups.append({**group_hyper(members, group), "params": indices})
        for i, fqn in zip(indices, members):
            if tensors[fqn]:
                state[i] = tensors[fqn]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


PREFIXES = {"tensor": TENSOR_PREFIX, "group": GROUP_PREFIX, "object": OBJECT_PREFIX,
            "group_object": GROUP_OBJECT_PREFIX}


def _group_id(hyper: dict[str, Any]) -> int:
    """The same hyperparameters give the same id on every rank (ids name DCP keys)."""
    text = repr(sorted((k, v.tolist() if isinstance(v, torch.Tensor) else v)
                       for k, v in hyper.items()))
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)
