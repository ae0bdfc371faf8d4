"""``torch.no_grad()`` inside ``forward``, for graphs traced by torch.fx.

torch.fx records operations, not the grad mode they ran under: ``with torch.no_grad(): t =
self.b(h)`` became an ordinary ``self.b(h)`` node, and the pipeline back-propagated through it,
training ``b`` and everything before it on gradients eager never computes (torch.export
records the mode itself). The fx tracer therefore notes the nodes it created with grad
disabled. A block that computes only from model inputs, buffers and constants (a mask, position
ids) needs no gradient in either mode and is kept; one that reads a parameter or a value that
requires grad is refused, so ``tracer="auto"`` captures the model with torch.export instead.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..errors import CaptureError


def check_no_grad_blocks(gm: fx.GraphModule, no_grad: set[fx.Node], alone: bool) -> None:
    """Raise CaptureError if a node made under ``no_grad`` reads something that requires grad
    (a parameter, or an activation computed with grad enabled)."""
    free: set[fx.Node] = set()  # values that need no gradient whatever the grad mode
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            free.add(node)
        elif node.op == "get_attr":
            if not _is_parameter(gm, str(node.target)):
                free.add(node)
        elif (node.op == "call_method" and node.target in ("detach", "size", "dim")) or (
                node.target is getattr and node.args[1:2] in (("shape",), ("dtype",),
                                                              ("device",), ("ndim",))):
            free.add(node)  # no gradient flows out of these
        elif node in no_grad and node.op != "output":
            reads = [i.name for i in node.all_input_nodes if i not in free]
            if _has_parameters(gm, node):
                reads.append(f"the parameters of {node.target}")
            if reads:
                raise CaptureError(
                    f"forward computes '{node.name}' under torch.no_grad() ({_where(node)}) "
                    f"from {reads}, which require grad: torch.fx does not record grad mode, "
                    "so the pipeline would back-propagate through it. "
                    + ("Use tracer='export' (or 'auto'), or d" if alone else "D")
                    + "etach what the block reads (h.detach()) and call no module with "
                    "parameters in it")
            free.add(node)
        elif all(i in free for i in node.all_input_nodes) and not _has_parameters(gm, node):
            free.add(node)  # computed from inputs, buffers and constants only


def _has_parameters(gm: fx.GraphModule, node: fx.Node) -> bool:
    return node.op == "call_module" and any(
        True for _ in gm.get_submodule(str(node.target)).parameters())


def _is_parameter(gm: fx.GraphModule, target: str) -> bool:
    value: object = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return isinstance(value, torch.nn.Parameter)


def _where(node: fx.Node) -> str:
    lines = [line.strip() for line in (node.stack_trace or "").splitlines() if line.strip()]
    return lines[-1] if lines else f"node {node.name}"
