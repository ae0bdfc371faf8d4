"""Pick the runtime for how this process was launched: one process, or one rank of many."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..capture import Captured
from ..codegen import Stage
from ..pipeline import Pipeline
from ..plan import Plan
from .local import LocalRuntime
from .precision import check_precision
from .setup import launched_distributed


def make_runtime(model: nn.Module, captured: Captured, stages: list[Stage], plan: Plan,
                 canonical: dict[str, str], *, loss_fn: Any, offload_stash: bool,
                 precision: str = "fp32", timeout: float | None = None) -> Pipeline:
    """The distributed runtime under torchrun (world size > 1), else the one-process one."""
    check_precision(precision)
    if launched_distributed():
        from .distributed import make_distributed_pipeline

        return make_distributed_pipeline(model, captured, stages, plan, canonical,
                                         loss_fn=loss_fn, offload_stash=offload_stash,
                                         precision=precision, timeout=timeout)
    pipe = Pipeline(model, captured, stages, plan, canonical, runtime=None)
    pipe.runtime = LocalRuntime(
        stages, assemble=pipe.assemble, loss_fn=loss_fn, schedule=plan.schedule,
        recompute=plan.recompute, micro_batch_size=plan.micro_batch_size,
        offload_stash=offload_stash, precision=precision,
    )
    return pipe
