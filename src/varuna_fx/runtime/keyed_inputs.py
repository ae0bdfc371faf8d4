"""Keyed dropout in a compiled stage: the masks drawn eagerly, handed to the graph as inputs.

A stage's keyed dropouts (``ir/keyed_calls.py``: ``nn.Dropout``, ``F.dropout``,
``aten.dropout``, each drawing its mask row by row from generators seeded per sample) read
the micro-batch's key from Python state and reseed a generator per row: nothing a compiled
graph can run. But a dropout is ``x * noise`` once its noise is drawn, and the noise depends
only on ``x``'s shape, dtype and device, the dropout's ``p`` and the key. So the background
compile (background_compile.py) compiles a copy of the stage graph in which each keyed
dropout is ``x * noise_i``, ``noise_i`` an input; each call draws every ``noise_i`` with
the very function the eager stage uses (``rng.keyed_noise``, the same seeds), so the masks
are eager's exactly and recompute replays them. The shapes come from the stage's first call,
run once through an fx interpreter that records them (its numbers are the module's own).

A stage with any other random op (an attention with dropout: ``keyed_sdpa``; ``randn_like``
and co: nodes ``split_stages`` marks with ``random_begin``) stays eager:
:func:`dropout_sites` returns None for it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from ..codegen.stage_module import Stage
from ..ir.keyed_calls import (
    keyed_aten_dropout,
    keyed_functional_dropout,
    keyed_module_dropout,
    keyed_sdpa,
)
from ..ir.rng import current_key, draw_seeds, keyed_noise, random_begin

# argument names after (first_op, per_sample), per keyed dropout
_SIGNATURES = {keyed_module_dropout: ("module", "x"),
               keyed_functional_dropout: ("x", "p", "training", "inplace"),
               keyed_aten_dropout: ("x", "p", "training")}
_DEFAULTS = {"p": 0.5, "training": True, "inplace": False}


@dataclass
class DropoutSite:
    """One keyed dropout of a stage: its node, its op number, and its settings' sources."""

    node: str  # the node's name in the stage graph
    first_op: int
    per_sample: tuple[bool, ...]
    module: str | None  # an nn.Dropout's FQN (its p and training read at each call)
    p: float = 0.5
    training: bool = True
    inplace: bool = False
    shape: tuple[int, ...] | None = None  # of x, recorded at the first call
    dtype: torch.dtype | None = None
    device: torch.device | None = None


def dropout_sites(stage: Stage) -> list[DropoutSite] | None:
    """The stage's keyed dropouts, or None where it has another random op (or a dropout
    whose settings are computed in the graph)."""
    sites = []
    for n in stage.module.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is random_begin or n.target is keyed_sdpa:  # another random op draws
            return None
        names = _SIGNATURES.get(n.target)
        if names is None:
            continue
        first_op, per_sample, *rest = n.args
        given = {**dict(zip(names, rest)), **n.kwargs}
        module = given.get("module")
        settings = {k: given.get(k, _DEFAULTS[k]) for k in ("p", "training", "inplace")}
        if any(isinstance(v, fx.Node) for v in settings.values()):
            return None
        fqn = str(module.target) if isinstance(module, fx.Node) else None
        if fqn is not None:  # an nn.Dropout: in place or not as it says (p, training: live)
            settings["inplace"] = stage.module.get_submodule(fqn).inplace
        sites.append(DropoutSite(n.name, int(first_op), tuple(per_sample), fqn,
                                 float(settings["p"]), bool(settings["training"]),
                                 bool(settings["inplace"])))
    return sites


class _Recorder(fx.Interpreter):
    """Runs the stage as its module would, noting each keyed dropout's input."""

    def __init__(self, module: fx.GraphModule, sites: list[DropoutSite]) -> None:
        super().__init__(module)
        self.sites = {s.node: s for s in sites}

    def run_node(self, n: fx.Node) -> Any:
        site = self.sites.get(n.name)
        if site is not None:
            x = self.env[n.args[3] if site.module is not None else n.args[2]]
            site.shape, site.dtype, site.device = tuple(x.shape), x.dtype, x.device
        return super().run_node(n)


def record_call(stage: Stage, sites: list[DropoutSite], values: dict[str, Any]
                ) -> dict[str, Any]:
    """``stage(values)``, recording each site's input shape."""
    return _Recorder(stage.module, sites).run(*[values[n] for n in stage.arg_names])


def with_noise_inputs(stage: Stage, sites: list[DropoutSite]) -> fx.GraphModule:
    """A copy of the stage module whose keyed dropouts multiply by noise inputs (after the
    stage's own inputs, in ``sites``' order)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    by_name = {s.node: s for s in sites}
    nodes = list(stage.module.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for n in placeholders:
        env[n] = graph.node_copy(n, env.__getitem__)
    noise = {s.node: graph.placeholder(f"noise_{i}") for i, s in enumerate(sites)}
    for n in nodes:
        if n.op == "placeholder":
            continue
        site = by_name.get(n.name)
        if site is None:
            env[n] = graph.node_copy(n, env.__getitem__)
            continue
        x = env[n.args[3] if site.module is not None else n.args[2]]
        env[n] = graph.call_method("mul_", (x, noise[n.name])) if site.inplace else \
            graph.call_function(operator.mul, (x, noise[n.name]))
    for n in list(graph.nodes):  # the nn.Dropouts' get_attr nodes, read by nothing now
        if n.op == "get_attr" and not n.users:
            graph.erase_node(n)
    return fx.GraphModule(stage.module, graph)


def draw_noise(stage: Stage, sites: list[DropoutSite]) -> list[torch.Tensor] | None:
    """Each site's noise for the call now, drawn as the eager stage draws it; None where a
    site would not draw (no key, eval, p of 0 or 1): such a call runs eagerly."""
    key = current_key()
    if key is None:
        return None
    out = []
    for s in sites:
        p, training = s.p, s.training
        if s.module is not None:
            dropout = stage.module.get_submodule(s.module)
            p, training = float(dropout.p), bool(dropout.training)
        assert s.shape is not None and s.dtype is not None
        if not training or p == 0 or p == 1 or 0 in s.shape:
            return None
        per_row = bool(s.per_sample and s.per_sample[0] and s.shape and s.shape[0] == key.batch)
        like = torch.empty(s.shape, dtype=s.dtype, device=s.device)
        out.append(keyed_noise(like, p, draw_seeds(key, s.first_op, per_row)))
    return out
