"""A compiled stage's backward split in two: input gradients at ``B``, weight gradients at ``W``.

Under a split-backward schedule (``*-zb``, ``zbv``, ``dualpipev``) a compiled stage goes through
:func:`split_backend`, a torch.compile backend: AOTAutograd traces and partitions the joint
graph as inductor's does, and the backward graph it hands over (saved values and output
gradients in; a gradient per forward input out) is cut here into

* the **input-gradient graph**: every node the gradients of the received values need, which
  also returns the values the weight gradients need from it (the *frontier*);
* the **weight-gradient graph**: the rest of what the parameters' gradients need, from the
  backward's own inputs and the frontier.

Both are compiled by inductor. The backward autograd calls (``B``) runs the first and returns
no gradient for the parameters; it queues the second, bound to its inputs, in
:data:`PENDING`; the worker takes what its ``B`` queued and runs it at the micro-batch's ``W``,
accumulating into the parameters' ``.grad`` as autograd's accumulators would. Nothing is
computed twice: the frontier is handed over, not recomputed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

# weight-gradient work queued by compiled backwards, taken by the worker right after its B
PENDING: list[Callable[[], None]] = []


class CompiledWeights:
    """What the ``W`` of one micro-batch runs: the weight-gradient graphs its ``B`` queued."""

    def __init__(self, work: list[Callable[[], None]]) -> None:
        self.work = work

    def run(self) -> None:
        for w in self.work:
            w()
        self.work = []


def take_pending(mark: int) -> CompiledWeights:
    """The work queued since ``len(PENDING)`` was ``mark``."""
    work = PENDING[mark:]
    del PENDING[mark:]
    return CompiledWeights(work)


def _ancestors(roots: Sequence[Any]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _accumulate(params: list[nn.Parameter], grads: Sequence[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        if p.grad is None:
            p.grad = g
        else:
            p.grad += g


def split_backward_graph(bw: fx.GraphModule, params: list[nn.Parameter | None]
                         ) -> Callable[[list[Any]], Any]:
    """``bw``: AOTAutograd's backward graph, one output per forward input; ``params``: per
    forward input, the parameter it is (None: an activation or model input)."""
    from torch._functorch.aot_autograd import make_boxed_func  # imported when compiling
    from torch._inductor.compile_fx import compile_fx_inner

    output = next(n for n in bw.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    assert len(outs) == len(params), "one gradient per forward input"
    a_idx = [k for k, o in enumerate(outs) if params[k] is None and isinstance(o, fx.Node)]
    w_idx = [k for k, o in enumerate(outs) if params[k] is not None and isinstance(o, fx.Node)]
    in_i, in_w = _ancestors([outs[k] for k in a_idx]), _ancestors([outs[k] for k in w_idx])
    inputs = [n for n in bw.graph.nodes if n.op == "placeholder"]
    # computed by the input-gradient graph and read by the weight-gradient graph
    frontier = [n for n in bw.graph.nodes if n in in_i and n.op != "placeholder" and
                any(u in in_w and u not in in_i for u in n.users)]
    gi, env = fx.Graph(), {}
    for n in bw.graph.nodes:
        if n.op == "placeholder" or (n in in_i and n.op != "output"):
            env[n] = gi.node_copy(n, env.__getitem__)
    gi.output(tuple(env[outs[k]] for k in a_idx) + tuple(env[f] for f in frontier))
    gw, envw = fx.Graph(), {}
    for n in inputs:
        envw[n] = gw.node_copy(n, envw.__getitem__)
    for f in frontier:
        envw[f] = gw.placeholder(f"frontier_{f.name}")
        envw[f].meta = dict(f.meta)
    for n in bw.graph.nodes:
        if n.op not in ("placeholder", "output") and n not in envw and n in in_w:
            envw[n] = gw.node_copy(n, envw.__getitem__)
    gw.output(tuple(envw[outs[k]] for k in w_idx))
    example = [n.meta["val"] for n in inputs]
    modules = [fx.GraphModule(bw, gi), fx.GraphModule(bw, gw)]
    for m in modules:  # what only the other half needs
        m.graph.eliminate_dead_code()
        m.recompile()
    dI = compile_fx_inner(modules[0], example, is_backward=True)
    dW = compile_fx_inner(modules[1], example + [f.meta["val"] for f in frontier],
                          is_backward=True)
    owners = [params[k] for k in w_idx]

    def run(*args: Any) -> list[Any]:
        kept = list(args)  # the saved values the weight pass still reads
        result = list(dI(list(kept)))
        grads, handed = result[:len(a_idx)], result[len(a_idx):]

        def weights() -> None:
            with torch.no_grad():
                _accumulate(owners, dW(kept + handed))  # type: ignore[arg-type]
        PENDING.append(weights)
        full: list[Any] = [None] * len(outs)
        for k, g in zip(a_idx, grads):
            full[k] = g
        return full

    return make_boxed_func(run)  # AOTAutograd's calling convention: one list of arguments


def split_backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """The torch.compile backend of a compiled stage under a split backward."""
    from torch._functorch import config as functorch_config
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table

    params: list[nn.Parameter | None] = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            arg = n.meta.get("grapharg")
            real = arg.example if arg is not None else None
            params.append(real if isinstance(real, nn.Parameter) else None)
    # no donated buffers: inductor may otherwise reuse a saved value's memory in the input
    # half, and the weight half, run later, reads those values (measured: wrong weight
    # gradients with several micro-batches)
    with functorch_config.patch(donated_buffer=False):
        return aot_module_simplified(
            gm, example_inputs, fw_compiler=compile_fx_inner,
            bw_compiler=lambda g, _: split_backward_graph(g, params),
            partition_fn=min_cut_rematerialization_partition,
            decompositions=select_decomp_table())
