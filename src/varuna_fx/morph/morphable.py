"""What an in-place morph reads of the pipeline it morphs and what it asks of it
(:class:`Morphable`), and what it asks of a re-plan (:class:`Replanner`).

The morph (``controller.py``) is the pipeline's other half: ``pipeline.py`` makes an
:class:`~.controller.InPlace` part of the ``Pipeline`` it constructs, so the morph cannot import
``Pipeline`` (a cycle) and ``api.Replan`` is a layer above. Both are named here as protocols
instead: every read and every request is listed once. The underscored members are the
pipeline's own: the morph drives them, a user never calls them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from ..capture.captured import Captured
from ..codegen.stage_module import Stage
from ..planner.cluster import Cluster
from ..planner.plan import Plan
from ..runtime.model_state import StateLayout
from ..runtime.options import RunOptions
from ..runtime.step import Runtime


class Morphable(Protocol):
    """The pipeline as a morph sees it (``pipeline.Pipeline`` implements it)."""

    # what it reads
    model: nn.Module
    captured: Captured  # the graph a re-plan cuts, and a stage's tensors' other holders
    canonical: dict[str, str]
    state_layout: StateLayout  # every tensor's full shape: what is allocated where it moves
    stages: list[Stage]
    plan: Plan
    runtime: Runtime  # the loss scale, the step's flags, the step-closing sum
    local_stages: list[int]
    replica_index: int
    _options: RunOptions  # how it runs (the morph re-plans for another global batch)
    _assemble: Callable[[dict[str, Any]], Any]  # the last stage's outputs -> the model's

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    # what it asks
    def _step(self, inputs: tuple, kw_inputs: dict[str, Any], target: Any,
              flags: tuple) -> torch.Tensor:
        """One step on the layout it has now (a failed one is run again after a morph)."""
        ...

    def _finish_saves(self) -> None:
        """Wait for a save in flight, and forget the checkpointer of the old world's group."""
        ...

    def _drop_runtime(self) -> Runtime:
        """The runtime, no longer held by the pipeline (its groups are destroyed next)."""
        ...

    def _set_layout(self, stages: list[Stage], plan: Plan, runtime: Runtime,
                    options: RunOptions) -> None:
        """Run ``plan``'s ``stages`` with ``runtime`` from now on: everything that depends on
        the layout (``Pipeline.__init__`` sets it up the same way)."""
        ...


class ReplanOptions(Protocol):
    """What a morph reads of compile's options (``options.CompileOptions``)."""

    @property
    def global_batch_size(self) -> int | None: ...

    @property
    def profile(self) -> Any: ...  # True: measured on the ranks (never in a pre-plan child)


class Replanner(Protocol):
    """How a morph plans for another world in this process (``api.Replan`` implements it)."""

    @property
    def cluster(self) -> Cluster: ...  # what compile planned for

    @property
    def options(self) -> ReplanOptions: ...

    def __call__(self, cluster: Cluster, global_batch_size: int
                 ) -> tuple[list[Stage], Plan, object]:
        """The stages and plan for ``cluster.gpus`` ranks (and compile's options, fitted)."""
        ...

    def search(self, cluster: Cluster, global_batch_size: int) -> None:
        """Only the planner's search for ``cluster.gpus`` ranks, kept by the plan cache."""
        ...
