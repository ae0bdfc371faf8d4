"""The pipeline's in-place face: ``pipe.morphs``, ``pipe.joined``, ``pipe.track`` and the
adoption of a re-planned layout by the same ``Pipeline`` object (a base class of it, so that
``pipeline.py`` keeps to its own concerns; the morph itself is ``controller.py``'s)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..capture.model_edits import ModelEdits, traced_modules
from .records import MorphRecord

if TYPE_CHECKING:
    from ..codegen.stage_module import Stage
    from ..planner.plan import Plan
    from ..runtime.step import Runtime
    from .controller import InPlace


class InPlaceFace:
    """What ``Pipeline`` shows of in-place morphing (docs/API.md, "Morphing in place")."""

    _in_place: InPlace | None = None  # an in-place job's morphing (morph/controller.py)

    @property
    def morphs(self) -> list[MorphRecord]:
        """Each in-place morph this process took part in: when, old and new layout, seconds
        per phase, bytes moved (``morph/records.py``). [] outside an in-place job."""
        return list(self._in_place.records) if self._in_place is not None else []

    @property
    def joined(self) -> bool:
        """This process joined a running in-place job and took its state from the others (so
        its script must not load a checkpoint into it)."""
        return self._in_place is not None and self._in_place.carried is not None

    def track(self, obj: Any) -> Any:
        """Register an object with ``state_dict``/``load_state_dict`` (an LR scheduler; a data
        loader is registered by ``data_loader``) for in-place morphing: a process that joins
        gets rank 0's state of it, and a loader continues with the new replica's share.
        Returns ``obj``; does nothing outside an in-place job."""
        if self._in_place is not None:
            self._in_place.track(obj)
        return obj

    def _note_checkpoint(self, path: str) -> None:
        """The latest checkpoint saved or loaded: what a morph restarts from if state is lost."""
        if self._in_place is not None:
            self._in_place.checkpoint = path

    def _adopt(self, stages: list[Stage], plan: Plan, runtime: Runtime) -> None:
        """Run ``plan`` with ``runtime`` from now on (an in-place morph re-planned)."""
        self.stages, self.plan, self.runtime = stages, plan, runtime
        self.stage_index, self.replica_index = runtime.stage_index, runtime.replica_index
        self.local_stages = runtime.local_stages
        self._replica_batch = self._options.replica_batch(plan.data_parallel)
        self._edits = ModelEdits(self.model, [stages[s].module for s in self.local_stages],
                                 traced_modules(self.captured.gm))
        # eval mode's stages were cut for the old stages ("the compiled graph serves" holds)
        self.other_modes = {k: v for k, v in self.other_modes.items() if v is None}
        self._checkpointer, self._meter = None, None
