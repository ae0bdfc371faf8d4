"""What the monitor reads of the pipeline it watches: :class:`Watched`.

The monitor sits below ``pipeline.py``, so it names the parts it reads as a protocol instead of
importing ``Pipeline`` (as ``checkpoint/checkpointable.py`` does for checkpoints).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from torch import nn

from ..codegen.stage_module import Stage
from ..planner.plan import Plan
from ..runtime.step import Runtime
from ..runtime.step_stats import StepStats


class Morphed(Protocol):
    """One in-place morph as the monitor logs it (``morph/records.MorphRecord``)."""

    def as_dict(self) -> dict[str, Any]: ...


class Watched(Protocol):
    """The parts of a pipeline ``vf.Monitor`` and the MFU's peak (``flops.py``) read."""

    plan: Plan  # the FLOPs per step, the placement (devices), the simulated timeline
    runtime: Runtime  # the precision's autocast; the timeout of the monitor's own group
    stages: list[Stage]
    local_stages: list[int]  # all of them: one process runs the model on one device
    last_step: StepStats | None  # what the step just logged measured

    @property
    def replicas(self) -> int: ...

    @property
    def morphs(self) -> Sequence[Morphed]: ...  # in place: grows when a step morphed

    def parameters(self) -> Iterator[nn.Parameter]: ...
