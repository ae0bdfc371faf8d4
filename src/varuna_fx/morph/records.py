"""``pipe.morphs``: what each in-place morph did, for logs, tests and the spot-trace bench."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..planner.plan import Plan


def layout_text(plan: Plan | None, world: int | None = None) -> str:
    """``"P=2 D=1 b=4 m=2"`` (and the world size when given)."""
    if plan is None:
        return "-"
    text = (f"P={plan.stages} D={plan.data_parallel} b={plan.micro_batch_size} "
            f"m={plan.num_micro_batches}")
    return text if world is None else f"{text} ({world} ranks)"


@dataclass
class MorphRecord:
    """One morph as this process saw it. ``phases``: seconds per phase, in order:

    * ``agree``: the step boundary's agreement on who leaves and joins (or, after a failure,
      the survivors finding each other in the store: at least the heartbeat window);
    * ``regroup``: the old process group destroyed, the new generation's formed;
    * ``replan``: configure and the back passes for the new world on this process's captured
      graph (no capture, no annotation);
    * ``runtime``: the plan agreed by every rank, its groups, this rank's tensors allocated;
    * ``transfer``: descriptors exchanged, the moves planned and sent point to point;
    * ``adopt``: optimizer state loaded, loaders re-sharded, unheld tensors released;
    * ``first_step``: the first step on the new layout (filled in when it finishes).

    ``bytes_moved``: bytes that crossed between processes, over all of them (every rank computes
    the same plan); ``bytes_received``: this process's share."""

    generation: int
    reason: str  # "notice" | "join" | "lost" | "joined" (this process joined a running job)
    started: float  # time.time() when this process began the morph
    old_layout: str
    new_layout: str
    phases: dict[str, float] = field(default_factory=dict)
    bytes_moved: int = 0
    bytes_received: int = 0
    joined: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()
    signal_at: float | None = None  # time.time() of the notice that caused it (its leaver's)
    # this process's CPU seconds per phase (on a loaded machine, what a phase would take alone)
    cpu: dict[str, float] = field(default_factory=dict)
    finished: float | None = None  # time.time() when its first step on the new layout ended
    _mark: float = field(default_factory=time.perf_counter, repr=False)
    _cpu_mark: float = field(default_factory=time.process_time, repr=False)

    def phase(self, name: str) -> None:
        """Close the phase ``name`` (seconds since the previous mark)."""
        now, cpu = time.perf_counter(), time.process_time()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._mark
        self.cpu[name] = self.cpu.get(name, 0.0) + cpu - self._cpu_mark
        self._mark, self._cpu_mark = now, cpu
        if name == "first_step":
            self.finished = time.time()

    @property
    def seconds(self) -> float:
        """The morph's seconds on this process, first step excluded."""
        return sum(v for k, v in self.phases.items() if k != "first_step")

    def as_dict(self) -> dict[str, Any]:
        return {"generation": self.generation, "reason": self.reason, "started": self.started,
                "old_layout": self.old_layout, "new_layout": self.new_layout,
                "phases": dict(self.phases), "bytes_moved": self.bytes_moved,
                "bytes_received": self.bytes_received, "joined": list(self.joined),
                "left": list(self.left), "lost": list(self.lost), "signal_at": self.signal_at,
                "cpu": dict(self.cpu), "finished": self.finished}
