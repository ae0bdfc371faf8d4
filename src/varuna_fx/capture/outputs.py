"""A forward's output as a flat tuple of leaves and the spec that rebuilds it."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.immutable_collections import immutable_dict, immutable_list


def _plain(value: Any) -> Any:
    """fx stores output structures as immutable collections; users expect dict/list."""
    if isinstance(value, immutable_dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, immutable_list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return type(value)({k: _plain(v) for k, v in value.items()})
    return value


PLAIN_DICTS = (dict, collections.OrderedDict, collections.defaultdict, immutable_dict)


def flatten_output(gm: fx.GraphModule, typed: Sequence[dict] = ()) -> pytree.TreeSpec:
    """The output node returns a flat tuple; the spec rebuilds forward's structure. ``typed``:
    the dict subclass forward returned as fx saw it (values: proxies), when it did."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    value = output.args[0]
    if typed and isinstance(value, dict) and list(value) == list(typed[0]):
        leaves, spec = pytree.tree_flatten(typed[0])
        output.args = (tuple(x.node if isinstance(x, fx.Proxy) else x for x in leaves),)
        gm.recompile()
        return spec
    leaves, spec = pytree.tree_flatten(_plain(value))
    output.args = (tuple(leaves),)
    gm.recompile()
    return spec


# -- torch.export --------------------------------------------------------------------------------
