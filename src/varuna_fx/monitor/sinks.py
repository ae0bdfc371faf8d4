"""Where the monitor's per-step records go: ``metrics.jsonl`` always, TensorBoard when
installed (the ``[tensorboard]`` extra).

One JSON object per line, plain data only (numbers, strings, null, lists of numbers); a
resumed run appends. Lines with an ``"event"`` key (an in-place morph: ``morph_events.py``)
are not step records. :func:`read_jsonl` reads a previous run's lines back as data (json: no
code runs), skipping any that are not records (a line cut by a crash). A ``"restart"`` event
(an in-place job started again from step ``s``: ``train/resume.py``) supersedes the
records before it of steps after ``s``: they were trained again, and are read as the later
ones.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from ..errors import InputError
from .history import read_history
from .morph_events import tensorboard_scalars

METRICS = "metrics.jsonl"
# a record's numbers that are not series: its step, its time, the assumed peak MFU is against
NOT_SCALARS = ("step", "time", "mfu_assumed_peak")


class JsonlSink:
    FLUSH_SECONDS = 1.0  # a killed run loses at most the last second's lines

    def __init__(self, directory: Path, flush_seconds: float = FLUSH_SECONDS) -> None:
        self.path = directory / METRICS
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.flushed = time.monotonic()
        self.flush_seconds = flush_seconds

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=False, default=_plain) + "\n")
        if time.monotonic() - self.flushed >= self.flush_seconds:  # a flush per line: ~1 ms
            self._file.flush()
            self.flushed = time.monotonic()

    def write_event(self, event: dict[str, Any]) -> None:
        """A line that is not a step's record (an in-place morph), flushed at once."""
        self._file.write(json.dumps(event, allow_nan=False, default=_plain) + "\n")
        self._file.flush()
        self.flushed = time.monotonic()

    def close(self) -> None:
        self._file.close()


def _plain(value: Any) -> Any:
    raise TypeError(f"not plain data: {type(value).__name__}")


def finite(value: float | None) -> float | None:
    """JSON has no inf/nan: those become null."""
    return value if value is not None and math.isfinite(value) else None


def read_jsonl(path: Path, before_step: int | None = None) -> list[dict[str, Any]]:
    """The step records of an earlier run in ``path`` (those with ``step < before_step``), as
    they stand after resumes and restarts (``history.read_history``, the one reader)."""
    return read_history(path, before_step).records


class TensorBoardSink:
    """Scalars under ``<out>/tensorboard``; :func:`tensorboard_sink` decides whether to have one.

    TensorBoard's writer hands every event to a thread of its own, and each hand-over wakes
    that thread: measured at about 4 ms of the training loop's time per event on a busy
    2-core machine (bench/bench_monitor.py). So records are kept and written every
    ``FLUSH_SECONDS`` (and at the end), one event per step holding all its scalars: one
    wake-up per flush."""

    FLUSH_SECONDS = 5.0

    def __init__(self, directory: Path, writer_cls: Any, scalar: Any) -> None:
        self.writer = writer_cls(str(directory / "tensorboard"))
        self.scalar = scalar
        self.pending: list[dict[str, Any]] = []
        self.flushed = time.monotonic()

    def write(self, record: dict[str, Any]) -> None:
        self.pending.append(record)
        if time.monotonic() - self.flushed >= self.FLUSH_SECONDS:
            self.flush()

    def write_event(self, event: dict[str, Any]) -> None:
        """An in-place morph: its seconds, phases and bytes under ``morph/`` at its step."""
        self.write(tensorboard_scalars(event))

    def flush(self) -> None:
        events = self.writer._get_file_writer()
        for record in self.pending:
            values = [v for key, value in record.items()
                      if key not in NOT_SCALARS and isinstance(value, int | float)
                      and not isinstance(value, bool) for v in self.scalar(key, value).value]
            summary = self.scalar("loss", 0.0)  # a Summary message to hold them all
            del summary.value[:]
            summary.value.extend(values)
            events.add_summary(summary, record["step"])
        self.pending = []
        self.flushed = time.monotonic()

    def close(self) -> None:
        self.flush()
        self.writer.close()


def tensorboard_sink(directory: Path, wanted: bool | None) -> TensorBoardSink | None:
    """``wanted`` None: when TensorBoard is installed; True: it must be; False: never."""
    if wanted is False:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import scalar
    except ImportError as exc:  # torch's module needs the tensorboard package
        if wanted:
            raise InputError("tensorboard=True, but TensorBoard is not installed: pip install "
                             "'varuna_fx[tensorboard]' (or pass tensorboard=None to write it "
                             "only when installed)") from exc
        return None
    return TensorBoardSink(directory, SummaryWriter, scalar)
