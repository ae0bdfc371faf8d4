"""``pipe.optimizer`` over a runtime's parameters, and pointing it at another layout's, in place.

``build_optimizer`` makes it: the user's class over this rank's parameters, or over their
shards when ``zero.py``'s sharding is on. An in-place morph (``morph/``) keeps the user's
optimizer object (LR schedulers and the loop hold it) and re-forms the pipeline under it:
``repoint_optimizer`` gives each param group the parameters the new layout holds, sharded over
the new D by the same rule, and empties the state, which the morph then fills from the tensors
that moved (``morph/transfer.py``). These take the runtime (``step.Runtime``), so they live
here, above ``grad_sync.py``, which ``zero.py`` is below.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...errors import OptimizerError
from ..step import Runtime
from .zero import (
    Made,
    ZeroLayout,
    ZeroSync,
    build_layout,
    check_elementwise,
    guard_direct_optimizers,
    install_hooks,
    made_by_pipeline,
    make_sharded,
    remember_made,
    set_layout,
    user_groups,
)


def sharded(runtime: Runtime, setting: bool | str) -> bool:
    """Whether ``pipe.optimizer`` shards over ``runtime``'s replicas with compile's
    ``shard_optimizer`` ``setting``: a distributed run with D > 1, unless told never to, or
    "auto" where the plan says not to (the replicas' link is slow, DiLoCo) and memory does not
    need it (``Plan.shards_by_default``)."""
    sync = runtime.grad_sync
    plan = runtime.plan
    unsharded = setting is False or (setting == "auto" and not plan.shards_by_default
                                      and not plan.shard_optimizer)
    return sync is not None and plan.data_parallel > 1 and not unsharded \
        and sync.groups.data_parallel is not None


def shard_layout(runtime: Runtime, groups: list[dict[str, Any]],
                 names: dict[int, str]) -> tuple[ZeroLayout, ZeroSync]:
    sync = runtime.grad_sync
    assert sync is not None and runtime.timeout is not None  # (sharded: a distributed run)
    group = sync.groups.data_parallel
    layout = build_layout(groups, names, set(sync.held), dist.get_rank(group=group),
                          runtime.plan.data_parallel)
    return layout, ZeroSync(layout, group, runtime.timeout, sync.who)


def build_optimizer(runtime: Runtime, named: dict[str, nn.Parameter], cls: type, params: Any,
                    defaults: dict[str, Any], setting: bool | str) -> torch.optim.Optimizer:
    """``pipe.optimizer``: ``cls`` over this rank's shards when sharding is on and D > 1 (a
    distributed run), else over the parameters themselves."""
    if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer):
        raise OptimizerError(f"pipe.optimizer takes a torch.optim.Optimizer class (e.g. "
                             f"torch.optim.AdamW), not {cls!r}")
    groups = user_groups(params, named)
    names = {id(p): n for n, p in named.items()}
    group_of = {names[id(p)]: gi for gi, g in enumerate(groups) for p in g["params"]}
    sync = runtime.grad_sync
    if not sharded(runtime, setting):
        optimizer = cls(groups, **defaults)
        remember_made(optimizer, Made(setting, sync, None, group_of))
        if sync is not None and sync.diloco is not None:  # its steps are DiLoCo's inner ones
            sync.diloco.attach(optimizer)
        return optimizer
    assert sync is not None
    check_elementwise(cls)
    layout, zero = shard_layout(runtime, groups, names)
    optimizer = make_sharded(cls, groups, layout, zero, defaults)
    made = remember_made(optimizer, Made(setting, sync, zero, group_of))
    install_hooks(optimizer, made)
    sync.zero = zero
    guard_direct_optimizers(named.values(), "pipe.optimizer shards their optimizer state "
                            "over the replicas (shard_optimizer)")
    return optimizer


def repoint_optimizer(optimizer: torch.optim.Optimizer, runtime: Runtime,
                      named: dict[str, nn.Parameter]) -> None:
    """Point an optimizer ``pipe.optimizer`` made at ``runtime``'s parameters (an in-place morph:
    the same object, so LR schedulers holding it carry on): each param group gets the held
    parameters that belonged to it (``Made.group_of``), sharded over the new D when the rule of
    ``build_optimizer`` says so. The state is emptied: the morph loads what moved. Nothing
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
    made.grad_sync = runtime.grad_sync
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
