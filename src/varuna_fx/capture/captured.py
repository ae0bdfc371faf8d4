"""What capture returns: the flat graph, its inputs' names and how to rebuild the output."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
import torch.utils._pytree as pytree


@dataclass
class Captured:
    gm: fx.GraphModule
    input_names: list[str]
    out_spec: pytree.TreeSpec
    tracer: str
    signature: inspect.Signature
    constants: dict[str, Any]
