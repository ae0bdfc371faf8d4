"""Pointing an optimizer ``pipe.optimizer`` made at another layout's parameters, in place.

An in-place morph (``morph/``) keeps the user's optimizer object (LR schedulers and the loop
hold it) and re-forms the pipeline under it: this gives each param group the parameters the new
layout holds, sharded over the new D by ``zero.py``'s rule, and empties the state, which the
morph then fills from the tensors that moved (``runtime/transfer.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .zero import (
    check_elementwise,
    guard_direct_optimizers,
    install_hooks,
    made_by_pipeline,
    set_layout,
    shard_layout,
    sharded,
)


def repoint_optimizer(optimizer: torch.optim.Optimizer, runtime: Any,
                      named: dict[str, nn.Parameter]) -> None:
    """Point an optimizer ``pipe.optimizer`` made at ``runtime``'s parameters (an in-place morph:
    the same object, so LR schedulers holding it carry on): each param group gets the held
    parameters that belonged to it (``Made.group_of``), sharded over the new D when the rule of
    ``zero.build_optimizer`` says so. The state is emptied: the morph loads what moved. Nothing
    else of a sharding outlives a step (``.grad`` is the averaged gradient on every replica;
    a shard's ``.grad`` is copied from it at ``opt.step()``), so there is no more to carry."""
    made = made_by_pipeline(optimizer)
    assert made is not None, "an optimizer pipe.optimizer made"
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []}
              for g in optimizer.param_groups]
    for name, p in named.items():
        if name in made.group_of:
            groups[made.group_of[name]]["params"].append(p)
    names = {id(p): n for n, p in named.items()}
    made.grad_sync = getattr(runtime, "grad_sync", None)
    if sharded(runtime, made.setting):
        check_elementwise(type(optimizer))
        layout, zero = shard_layout(runtime, groups, names)
        for gi, group in enumerate(optimizer.param_groups):
            group["params"] = layout.group_members(gi)
        set_layout(optimizer, layout)
        install_hooks(optimizer, made)
        made.zero = zero
        made.grad_sync.zero = zero
        guard_direct_optimizers(named.values(), "pipe.optimizer shards their optimizer state "
                                "over the replicas (shard_optimizer)")
    else:
        for group, mine in zip(optimizer.param_groups, groups):
            group["params"] = mine["params"]
        set_layout(optimizer, None)
        made.zero = None
    optimizer.state.clear()
