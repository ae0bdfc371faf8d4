"""The last stage's result dict -> the model's output structure (tensor, tuple, dict, HF
``ModelOutput``), as captured."""

from __future__ import annotations

from typing import Any

import torch.fx as fx
import torch.utils._pytree as pytree

from ..capture.captured import Captured
from ..passes.split_stages import output_key

_FROM_STAGE = object()  # an output leaf computed by the last stage (not a constant)


class OutputAssembler:
    def __init__(self, captured: Captured) -> None:
        self.out_spec = captured.out_spec
        output = next(n for n in reversed(captured.gm.graph.nodes) if n.op == "output")
        # constants the model returns (None in nanoGPT's ``(logits, None)``) are kept; tensors
        # come from the last stage
        self.template = [_FROM_STAGE if isinstance(leaf, fx.Node) else leaf
                         for leaf in output.args[0]]

    def __call__(self, outputs: dict[str, Any]) -> Any:
        leaves = [outputs[output_key(i)] if const is _FROM_STAGE else const
                  for i, const in enumerate(self.template)]
        return pytree.tree_unflatten(leaves, self.out_spec)
