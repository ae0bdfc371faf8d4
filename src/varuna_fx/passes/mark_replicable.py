"""mark_replicable: values every stage can compute for itself instead of receiving.

Every stage has the batch, so anything cheap that depends only on model inputs, buffers and
constants -- ``input_ids.size()``, position ids, attention-mask arithmetic, a causal mask, a
view of a weight -- is copied into each stage that uses it rather than sent. This keeps
non-tensor values (shapes, ints) off the network and frees the partitioner from cutting where
they flow. A node is replicable when all its inputs are, it is not random, it does no
matmul-class work and it is not a module call with state; a node reading a trainable parameter
qualifies only if it is a pure view of it (a transpose), so no work on weights is duplicated.
Nor does a node reading a buffer the graph writes (``self.steps += 1`` reads ``steps`` before
writing it): a copy on a later stage would run after the write and read the new value.

A replicable node is computed only inside the stages that use it, so one nobody uses is never
computed: it is erased, with the ``get_attr`` reads that fed only it. Otherwise its parameter
reads would still count although no stage holds them -- e.g. ``y * self.buf`` feeding only a
dropout that capture kept (random ops survive dead-code elimination) but whose ``p=0`` made it
deterministic, hence replicable and dead.
"""

from __future__ import annotations

import inspect

import torch
import torch.fx as fx

from ..capture.buffers import mutated_buffers
from ..ir.nodes import info


def mark_replicable(gm: fx.GraphModule) -> None:
    trainable = {name for name, p in gm.named_parameters(remove_duplicate=False)
                 if p.requires_grad}
    written = set(mutated_buffers(gm))
    reads_weight: dict[fx.Node, bool] = {}
    reads_written: dict[fx.Node, bool] = {}  # through replicable nodes
    for node in gm.graph.nodes:
        meta = info(node)
        inputs = node.all_input_nodes
        reads_weight[node] = (
            (node.op == "get_attr" and str(node.target) in trainable)
            or any(reads_weight[i] for i in inputs)
        )
        reads_written[node] = (
            (node.op == "get_attr" and str(node.target) in written)
            or any(reads_written[i] and info(i).replicable for i in inputs)
        )
        if node.op in ("placeholder", "get_attr"):
            meta.replicable = True
        elif node.op == "output":
            meta.replicable = False
        else:
            meta.replicable = (
                all(info(i).replicable for i in inputs)
                and not meta.random
                and not meta.mutates  # a side effect happens once, on one stage
                and meta.matmul_flops.const == 0 and meta.matmul_flops.per_sample == 0
                and not _stateful_module(gm, node)
                and (not reads_weight[node] or _is_free(meta))
                and not reads_written[node]
            )
    _erase_unused_replicable(gm)


def _erase_unused_replicable(gm: fx.GraphModule) -> None:
    """Erase replicable nodes without users, last first so a dead chain goes whole. Inputs stay
    (they are the model's signature) and so do impure nodes (``_assert_scalar``). Randomness is
    judged by ``NodeInfo.random`` (a replicable node is not random), not by fx, which calls
    ``dropout(p=0)`` impure."""
    erased = False
    for node in reversed(gm.graph.nodes):
        if (not node.users and node.op != "placeholder" and info(node).replicable
                and not _impure(node)):
            gm.graph.erase_node(node)
            erased = True
    if erased:
        gm.recompile()


def _impure(node: fx.Node) -> bool:
    # newer torch takes ``impure_random``; older versions have no such argument
    if "impure_random" in inspect.signature(fx.Node.is_impure).parameters:
        return node.is_impure(impure_random=False)
    return node.is_impure()


def _is_free(meta) -> bool:  # noqa: ANN001
    return meta.elementwise_flops.const == 0 and meta.elementwise_flops.per_sample == 0


def _stateful_module(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op != "call_module":
        return False
    module: torch.nn.Module = gm.get_submodule(str(node.target))
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())
