"""What a process offers the running in-place job it would join: its model and compile's
options as plain text (``world/admission.py`` compares them; a joiner that differs is refused).

The model is a digest of what fixes its state and its numbers: every parameter's and buffer's
name, shape and dtype, and the captured graph's operations in order (each node's kind and
target: no node names or addresses, which differ between processes running the same code).
The options are those that shape the plan or the numbers; the cluster, the profile, the
timeout and dumps are per process and left out.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from torch import fx, nn

from ..world.admission import plain

# compile options a process may set for itself (where it runs, what it waits, what it dumps)
_PER_PROCESS = {"cluster", "profile", "timeout", "dump"}


def model_digest(model: nn.Module, gm: fx.GraphModule) -> str:
    """A digest of the model's tensors (names, shapes, dtypes) and its graph's operations."""
    h = hashlib.sha256()
    for kind, named in (("p", model.named_parameters()), ("b", model.named_buffers())):
        for name, t in named:
            h.update(f"{kind} {name} {tuple(t.shape)} {t.dtype}\n".encode())
    for node in gm.graph.nodes:
        h.update(f"{node.op} {_target(node)} {len(node.args)} {sorted(node.kwargs)}\n".encode())
    return h.hexdigest()[:16]


def _target(node: fx.Node) -> str:
    if node.op == "call_function":
        try:
            return fx.node._get_qualified_name(node.target)  # type: ignore[arg-type]
        except (AttributeError, RuntimeError, TypeError):
            return plain(node.target)
    return str(node.target) if node.op in ("call_method", "call_module", "get_attr") else ""


def fingerprint(model: nn.Module, gm: fx.GraphModule, options: Any) -> dict[str, str]:
    """``{"model": digest, "compile.<option>": value, ...}`` for ``world/admission.py``."""
    parts = {"model": model_digest(model, gm)}
    for f in dataclasses.fields(options):
        if f.name not in _PER_PROCESS:
            parts[f"compile.{f.name}"] = plain(getattr(options, f.name))
    return parts
