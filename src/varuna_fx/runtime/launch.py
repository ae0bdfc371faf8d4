"""Pick the runtime for how this process was launched: one process, or one rank of many."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..capture import Captured
from ..codegen import Stage
from ..pipeline import Pipeline
from ..plan import Plan
from .local import LocalRuntime


def make_runtime(model: nn.Module, captured: Captured, stages: list[Stage], plan: Plan,
                 canonical: dict[str, str], *, loss_fn: Any, offload_stash: bool) -> Pipeline:
    pipe = Pipeline(model, captured, stages, plan, canonical, runtime=None)
    pipe.runtime = LocalRuntime(
        stages, assemble=pipe.assemble, loss_fn=loss_fn, schedule=plan.schedule,
        recompute=plan.recompute, micro_batch_size=plan.micro_batch_size,
        offload_stash=offload_stash,
    )
    return pipe
