"""What one ``pipe.step`` measured: ``pipe.last_step``.

:class:`StepMeter` brackets a step: wall seconds (after the device finished: CUDA is
synchronised, the distributed step already ends on a host all-reduce), the bytes this process
sent (``traffic.py``), its peak memory so far and the timeline of its actions, which the
runtimes append to ``runtime.timeline`` (``local.py``, ``executor.py``: two clock reads and one
tuple per action, send, wait and tail op -- a few microseconds per step next to milliseconds,
see bench/bench_monitor.py; ``record_timeline = False`` turns it off).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .step import Runtime
from .traffic import SENT

try:  # peak resident memory; POSIX only
    import resource
except ImportError:  # pragma: no cover - Windows
    resource = None  # type: ignore[assignment]


class TimedAction(NamedTuple):
    """One thing a rank did during a step, in seconds from the step's start on that rank.
    ``kind``: "F", "R", "B", "W" (compute), "send", "wait" (for a message) or "sync" (the
    step's tail: gradient reductions and the wait for them); ``mb`` -1 for "sync"."""

    stage: int
    kind: str
    mb: int
    start: float
    end: float


@dataclass(frozen=True)
class StepStats:
    """``pipe.last_step``: what the last ``pipe.step`` measured on this process."""

    seconds: float  # wall time of the step on this process
    predicted_seconds: float | None  # the plan's simulated step (plan.predicted_step_time)
    samples: int  # samples of the step over every replica (the global batch)
    tokens: int | None  # tokens of the step over every replica, when the input holds token ids
    bytes_sent: int  # bytes this process sent during the step (traffic.py)
    peak_memory: int  # bytes: this process's peak RSS (CPU) or max_memory_allocated (CUDA)
    rank: int = 0
    _raw: tuple[tuple[int, str, int, float, float], ...] = field(default=(), repr=False)
    _origin: float = field(default=0.0, repr=False)

    @property
    def timeline(self) -> list[TimedAction]:
        """Every action of the step on this process (all stages in one process)."""
        return [TimedAction(s, k, mb, a - self._origin, b - self._origin)
                for s, k, mb, a, b in self._raw]


def peak_memory(device: torch.device | None) -> int:
    """This process's peak memory: ``max_memory_allocated`` on CUDA, else the peak RSS."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if resource is None:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


def token_count(tensors: dict[str, torch.Tensor]) -> int | None:
    """The tokens of a batch: the elements of its first integer input (token ids), if any."""
    for t in tensors.values():
        if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            return t.numel()
    return None


class StepMeter:
    """Brackets each step of one pipeline (``start`` then ``finish``)."""

    record_timeline = True

    def __init__(self, runtime: Runtime, replicas: int) -> None:
        self.runtime, self.replicas = runtime, replicas
        self.rank = runtime.rank
        self.device = _device_of(runtime)
        self._began = 0.0
        self._sent = 0

    def start(self) -> None:
        self.runtime.timeline = [] if self.record_timeline else None
        self._sent = SENT.total
        self._began = time.perf_counter()

    def finish(self, tensors: dict[str, torch.Tensor]) -> StepStats:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's kernels, not their launches
        seconds = time.perf_counter() - self._began
        batch = next(iter(tensors.values())).shape[0] if tensors else 0
        tokens = token_count(tensors)
        return StepStats(
            seconds=seconds, predicted_seconds=self.runtime.plan.predicted_step_time,
            samples=batch * self.replicas,
            tokens=None if tokens is None else tokens * self.replicas,
            bytes_sent=SENT.total - self._sent, peak_memory=peak_memory(self.device),
            rank=self.rank, _raw=tuple(self.runtime.timeline or ()), _origin=self._began)


def _device_of(runtime: Runtime) -> torch.device | None:
    if runtime.device is not None:
        return runtime.device
    for stage in runtime.stages:
        for p in stage.module.parameters():
            return p.device
    return None
