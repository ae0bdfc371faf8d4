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

from ..codegen.stage_module import Stage
from ..planner.plan import Plan
from ..runtime.model_state import StateLayout
from ..runtime.step import Runtime


class Checkpointable(Protocol):
    """The parts of a pipeline a checkpoint (or Hugging Face weights) is saved from and
    loaded into."""

    plan: Plan  # the layout recorded in the marker
    runtime: Runtime  # the fp16 loss scaler, the timeout, the replicas' gradient sync
    replica_index: int  # whose replica-sync state this process saves (checkpoint/sync_state.py)
    state_layout: StateLayout  # every FQN's full shape: a checkpoint of another model is refused
    # what Hugging Face weights are read into and written from (checkpoint/hf/pretrained.py)
    model: nn.Module
    canonical: dict[str, str]  # every FQN -> its canonical name (tied weights are one)
    stages: list[Stage]
    local_stages: list[int]  # the stages this process holds

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...
