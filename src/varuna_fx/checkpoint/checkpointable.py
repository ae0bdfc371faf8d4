"""What checkpoints need of a pipeline: :class:`Checkpointable`.

The checkpoint layer sits below ``pipeline.py``, so it names the pipeline's parts it reads as a
protocol instead of importing ``Pipeline``. It only reads them: the pipeline owns its
checkpointer and the refusal a failed load leaves (``Pipeline._checkpointer``,
``Pipeline._failed_load``); ``Checkpointer.load`` returns that refusal instead of setting it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from ..planner.plan import Plan
from ..runtime.model_state import StateLayout
from ..runtime.step import Runtime


class Checkpointable(Protocol):
    """The parts of a pipeline a checkpoint is saved from and loaded into."""

    plan: Plan  # the layout recorded in the marker
    runtime: Runtime  # the fp16 loss scaler, and the timeout of a distributed runtime
    state_layout: StateLayout  # every FQN's full shape: a checkpoint of another model is refused

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...
