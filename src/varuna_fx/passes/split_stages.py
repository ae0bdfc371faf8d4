"""split_stages: one fx.Graph per stage, with explicit boundaries.

Each stage graph takes the model inputs it reads and the values it receives as placeholders
(named after the producing node, so ``add_11`` in stage 1 *is* stage 0's ``add_11``), copies
its own nodes plus the replicable ones it needs, and returns a dict: every value a later stage
needs (sent once, to each consumer stage directly, so long skip connections arrive without
relaying) and, on the last stage, the model's output leaves as ``output_<i>``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from ..ir.keyed_calls import direct_call, keyed_function, keyed_module_dropout
from ..ir.nodes import NodeInfo, StageSpec, TensorInfo, Transfer, copied_meta, copy_info, info
from ..ir.rng import random_begin, random_end
from .layout_robust import robust_views


@dataclass
class StageGraph:
    spec: StageSpec
    graph: fx.Graph


def output_key(i: int) -> str:
    return f"output_{i}"


def _needed_replicables(node: fx.Node, into: set[fx.Node], inputs: set[fx.Node]) -> None:
    for inp in node.all_input_nodes:
        if inp.op == "placeholder":
            inputs.add(inp)
        elif info(inp).replicable and inp not in into:
            into.add(inp)
            _needed_replicables(inp, into, inputs)


def requiring_grad(gm: fx.GraphModule, trainable: set[str]) -> set[fx.Node]:
    """Nodes whose value depends differentiably on a trainable parameter (model inputs are
    data and need no gradient). Decided statically so peers need not exchange metadata."""
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        floating = any(t.dtype.is_floating_point or t.dtype.is_complex
                       for t in info(node).outputs)
        if floating and not _cuts_gradient(node) and (
                any(p in trainable for p in info(node).params)
                or any(i in found for i in node.all_input_nodes)):
            found.add(node)
    return found


_DETACH = {torch.detach, torch.Tensor.detach, torch.ops.aten.detach.default}


def _cuts_gradient(node: fx.Node) -> bool:
    """``h.detach()``, ``h.data`` and export's ``torch.no_grad()`` blocks: no gradient flows
    out, so a value made from them is sent as data (a stage that received it as a leaf
    requiring grad wrote that into a buffer: ``self.ema = 0.9 * self.ema + h.detach()``)."""
    if node.op == "call_method":
        return node.target == "detach"
    if node.op != "call_function":
        return False
    if node.target in _DETACH:
        return True
    if node.target is getattr:
        return node.args[1:2] == ("data",)
    return node.target is getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None) \
        and node.args[:1] == (False,)


def split_stages(gm: fx.GraphModule, num_stages: int, trainable: set[str],
                 stage_of_node: dict[fx.Node, int] | None = None) -> list[StageGraph]:
    """``stage_of_node``: the stage of each compute node, when not the one assign_stages wrote
    into its annotations (the profiler cuts chunks of its own without touching the graph)."""
    assigned = stage_of_node if stage_of_node is not None else \
        {n: info(n).stage for n in gm.graph.nodes}
    grad_nodes = requiring_grad(gm, trainable)
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    output = nodes[-1]
    last = num_stages - 1

    def stage_of(n: fx.Node) -> int:
        return last if n.op == "output" else assigned[n]  # type: ignore[return-value]

    owned: list[list[fx.Node]] = [[] for _ in range(num_stages)]
    for n in nodes:
        if n.op not in ("placeholder", "get_attr", "output") and not info(n).replicable:
            owned[assigned[n]].append(n)  # type: ignore[index]
    # Who needs which computed value: consumer stages of every non-replicable node.
    consumers: dict[fx.Node, set[int]] = {n: set() for s in owned for n in s}
    for n in [*[x for s in owned for x in s], output]:
        for inp in n.all_input_nodes:
            if inp in consumers and stage_of(inp) != stage_of(n):
                consumers[inp].add(stage_of(n))
    transfers = [
        Transfer(n.name, stage_of(n), dst, _tensor(n), info(n).out_bytes, n in grad_nodes)
        for n in sorted(consumers, key=order.__getitem__) for dst in sorted(consumers[n])
    ]
    first_ops = random_op_numbers(nodes)
    direct = {n for n in nodes if info(n).random and len(info(n).random_draws) == 1
              and direct_call(gm, n)}
    return [_stage_graph(s, nodes, owned[s], transfers, last, first_ops, direct)
            for s in range(num_stages)]


def random_op_numbers(nodes: list[fx.Node]) -> dict[fx.Node, int]:
    """How many random ops the forward runs before each node (graph order is the order eager
    runs them; an op that draws nothing is none: ir/rng.draws): their keys (ir/rng.py)."""
    first: dict[fx.Node, int] = {}
    k = 0
    for n in nodes:
        first[n] = k
        k += len(info(n).random_draws)
    return first


def _stage_graph(s: int, nodes: list[fx.Node], owned: list[fx.Node],
                 transfers: list[Transfer], last: int,
                 first_ops: dict[fx.Node, int], direct: set[fx.Node]) -> StageGraph:
    """Copy stage ``s``'s nodes (and the replicable ones they need) into a graph of its own.
    ``direct``: the plain dropouts and attentions, called keyed (ir/keyed_calls.py)."""
    by_name = {n.name: n for n in nodes}
    output = nodes[-1]
    body = owned + ([output] if s == last else [])
    replicated: set[fx.Node] = set()
    placeholders: set[fx.Node] = set()
    for n in body:
        _needed_replicables(n, replicated, placeholders)
    recvs = [t for t in transfers if t.dst == s]
    sends = [t for t in transfers if t.src == s]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = [p for p in nodes if p in placeholders]
    for p in inputs:
        env[p] = graph.placeholder(p.name)
        env[p].meta = copied_meta(p.meta)
    for t in {t.name: t for t in recvs}.values():  # one placeholder per value
        src = by_name[t.name]
        env[src] = graph.placeholder(t.name)
        # shapes and source for the generated code, but not the producer's parameters
        env[src].meta = {**src.meta, "varuna": replace(copy_info(info(src)), params={})}
    members = replicated | set(owned)
    # A stage that writes in place works on copies of what arrives (a received activation is
    # an autograd leaf, which cannot be written, and a recompute replays from it) and sends
    # copies taken where a value is made (a later write in the stage, or to the buffer a value
    # is, must not reach a consumer that read it before).
    writes = any(info(n).mutates for n in members)
    if writes:
        for src, placeholder in list(env.items()):
            env[src] = _copy(graph, placeholder)
    sent = {t.name for t in sends}
    results: dict[str, fx.Node] = {}
    for n in nodes:
        if n in members:
            random = info(n).random  # dropout & co: keyed by (step seed, op, sample)
            if n in direct:
                env[n] = _keyed_call(graph, n, env, first_ops[n])
            else:
                if random:
                    _marker(graph, random_begin, (first_ops[n], info(n).random_draws))
                env[n] = graph.node_copy(n, env.__getitem__)
                env[n].meta = copied_meta(n.meta)
                if random:
                    _marker(graph, random_end, ())
            if n.name in sent:
                results[n.name] = _copy(graph, env[n]) if writes else env[n]
    results = {name: results[name] for name in dict.fromkeys(t.name for t in sends)}
    outputs = []
    if s == last:
        for i, leaf in enumerate(output.args[0]):
            if isinstance(leaf, fx.Node):
                results[output_key(i)] = env[leaf]
                outputs.append(i)
    graph.output(results)
    robust_views(graph)  # a received or re-joined tensor may be laid out otherwise
    graph.lint()
    spec = StageSpec(
        index=s, inputs=[str(p.target) for p in inputs], recvs=recvs, sends=sends,
        outputs=outputs, nodes=[n.name for n in owned],
        parameter_names=[],  # filled in by codegen, which knows the model's order
    )
    return StageGraph(spec, graph)


def _marker(graph: fx.Graph, fn: object, args: tuple) -> None:
    marker = graph.call_function(fn, args)  # type: ignore[arg-type]
    marker.meta["varuna"] = NodeInfo(is_tensor=False, replicable=True)


def _keyed_call(graph: fx.Graph, n: fx.Node, env: dict[fx.Node, fx.Node],
                first_op: int) -> fx.Node:
    """``n`` (a plain dropout or attention) as a call of its keyed version, with ``n``'s
    annotations."""
    args = fx.map_arg(n.args, env.__getitem__)
    kwargs = fx.map_arg(n.kwargs, env.__getitem__)
    head = (first_op, info(n).random_draws)
    if n.op == "call_module":
        module = graph.create_node("get_attr", str(n.target), name=f"{n.name}_module")
        module.meta["varuna"] = NodeInfo(is_tensor=False, replicable=True)
        call = graph.create_node("call_function", keyed_module_dropout,
                                 (*head, module, *args), kwargs, name=n.name)
    else:
        call = graph.create_node("call_function", keyed_function(n.target), (*head, *args),
                                 kwargs, name=n.name)
    call.meta = copied_meta(n.meta)
    return call


def _copy(graph: fx.Graph, node: fx.Node) -> fx.Node:
    copy = graph.call_method("clone", (node,))
    copy.meta = {**copied_meta(node.meta),
                 "varuna": replace(copy_info(info(node)), params={}, replicable=True)}
    return copy


def _tensor(n: fx.Node) -> TensorInfo:
    return info(n).outputs[0]
