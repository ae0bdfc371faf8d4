"""``vf.Monitor``: watch a pipeline train.

Every rank calls ``monitor.log(loss)`` after each step (and ``close()`` at the end); rank 0
alone prints and writes. Per step a record of what ``pipe.last_step`` measured: loss, step
time beside the plan's prediction, samples/s and tokens/s, MFU (``flops.py``), this rank's
peak memory and bytes sent; every ``memory_every`` steps (and at the end) rank 0 gathers the
peak memory and bytes sent of every rank (one small gather on a gloo group of the monitor's
own, so it never interleaves with training's messages). Records go to ``metrics.jsonl`` and
TensorBoard (``sinks.py``), optionally Weights & Biases (``wandb_sink.py``), and to the live
line (``display.py``). ``charts()`` (collective, also run by ``close()``) gathers every rank's
timeline of the last step to rank 0, which draws ``charts/training.png``
(``training_chart.py``) and ``charts/timeline.png`` (``charts.py``).

Each launch's first record holds the ``layout`` it runs on (``P=2 D=1 b=2 m=2 (2 ranks)``); a
resumed run (``start_step`` > 0) first writes a ``"resume"`` event with its layout and the one
the file last named, so the charts and ``varuna-fx report`` mark where it resumed and whether
on another layout (``history.py``). MFU against an assumed peak (every CPU: ``flops.py``) is
written with that peak (``mfu_assumed_peak``) and shown as an estimate naming it.

Throughput and MFU are over the loop's time per step (from one ``log`` to the next: the
optimizer step and data loading included) once there is a previous step, else over
``pipe.step``'s own time; ``step_seconds`` is always ``pipe.step``'s, the figure to hold
against the plan's ``predicted_step_seconds``.

In an in-place job (``varuna-fx run/train --elastic --in-place``) the monitor follows the
pipeline through its morphs: the step during which ``pipe.morphs`` grew is rated over
``pipe.step``'s own time (the loop's holds the stall), the gloo group is made again on the new
generation (a morph destroys every group), MFU counts the new world's devices, rank 0 writes
each morph as an event (``morph_events.py``), and a process that became rank 0 takes over the
outputs. A process that joins makes its own monitor with the step it starts at.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from rich.console import Console

from ..costs.memory import format_bytes
from ..errors import InputError
from ..runtime.step_stats import StepStats
from ..runtime.traffic import SENT
from ..world.membership import in_place
from ..world.where import launched_distributed
from .charts import timeline_chart
from .display import Display
from .flops import peak_of, step_flops
from .history import RESUME_EVENT, marks, read_history
from .morph_events import describe_morph, layout_text, morph_event
from .sinks import METRICS, JsonlSink, finite, tensorboard_sink
from .training_chart import training_chart
from .wandb_sink import check_wandb_setting, wandb_sink
from .watched import Watched

CHARTS = "charts"


class Monitor:
    """Watch ``pipe`` train; output under ``out_dir`` (rank 0). Construct, ``log`` and
    ``close`` on every rank. ``total_steps``: for the progress bar; ``start_step``: the step
    the run resumes at (earlier records of ``metrics.jsonl`` are kept for the charts, later
    ones -- steps repeated after a restore -- are dropped from them); ``print_every``: plain
    lines every so many steps when not on a terminal; ``live``: None decides by the terminal;
    ``tensorboard``: None when installed, True required, False never; ``peak_flops``: the
    device's peak FLOP/s for MFU (None: ``flops.py``'s table); ``tokens_per_sample``: when the
    inputs do not hold token ids (None: counted from an integer input); ``charts``: whether
    ``close`` draws the charts (``charts()`` draws them on demand either way); ``wandb``:
    Weights & Biases too -- True, or a dict of ``wandb.init`` arguments (offline unless
    ``WANDB_MODE`` or ``mode`` says otherwise: ``wandb_sink.py``)."""

    def __init__(self, pipe: Watched, out_dir: str | Path, *, total_steps: int | None = None,
                 start_step: int = 0, print_every: int = 10, memory_every: int = 50,
                 live: bool | None = None, tensorboard: bool | None = None,
                 peak_flops: float | None = None, tokens_per_sample: int | None = None,
                 console: Console | None = None, charts: bool = True,
                 wandb: bool | dict[str, Any] = False) -> None:
        check_wandb_setting(wandb)
        for name, value, low in (("print_every", print_every, 1), ("memory_every", memory_every, 1),
                                 ("start_step", start_step, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(f"Monitor: {name} must be an integer >= {low}, got {value!r}")
        self.pipe = pipe
        self.out = Path(out_dir)
        self.step = start_step
        self.memory_every = memory_every
        self.tokens_per_sample = tokens_per_sample
        self.draw_at_close = charts
        self._peak_flops = peak_flops
        self.peak = peak_of(pipe, peak_flops)
        self._outputs = dict(console=console, live=live, total=total_steps,
                             print_every=print_every, tensorboard=tensorboard, wandb=wandb)
        self.group = None  # the monitor's gloo group, made when first used (``_group``)
        self.distributed = launched_distributed() and dist.is_initialized()
        self.rank, self.world = 0, 1
        if self.distributed:
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # in-place morphs seen (a process that joined a running job saw its own join already)
        self._morphs_seen = len(pipe.morphs)
        self.records: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []  # rank 0's: resumes and morphs, for the charts
        self._layout_said = False  # this launch's first record names its layout
        self._last: StepStats | None = None
        self._logged_at: float | None = None
        self._closed = False
        self.display: Display | None = None
        self.sinks: list[Any] = []
        if self.rank == 0:
            self._open_outputs(start_step)
            if start_step and not getattr(pipe, "joined", False):
                self._write_line_event({"event": RESUME_EVENT, "step": start_step + 1,
                                        "layout": self._layout(),
                                        "previous_layout": self._earlier_layout})

    def _layout(self) -> str:
        return layout_text(self.pipe.plan, self.world if self.distributed else None)

    def _write_line_event(self, event: dict[str, Any]) -> None:
        """An event line of metrics.jsonl alone (TensorBoard and W&B take numbers per step)."""
        for sink in self.sinks:
            if isinstance(sink, JsonlSink):
                sink.write_event(event)
        self.events.append(event)

    def _open_outputs(self, start_step: int) -> None:
        """Rank 0's: the records and events so far (for the charts), the sinks, the line."""
        self.out.mkdir(parents=True, exist_ok=True)
        # (a step logged again supersedes the earlier lines from it on: history.py)
        earlier = read_history(self.out / METRICS, before_step=start_step + 1) \
            if start_step else None
        self.records = earlier.records if earlier is not None else []
        self.events = earlier.events if earlier is not None else []
        self._earlier_layout = earlier.layout if earlier is not None else None
        # in place, rank 0 may be killed and another process go on writing: every line is
        # flushed, so the file has no gap where the killed one's unflushed lines were
        self.sinks = [JsonlSink(self.out, 0.0 if in_place() else JsonlSink.FLUSH_SECONDS)]
        board = tensorboard_sink(self.out, self._outputs["tensorboard"])
        if board is not None:
            self.sinks.append(board)
        try:
            tracker = wandb_sink(self.out, self._outputs["wandb"], self._run_config())
        except Exception:  # (a refusal: the files opened so far are closed, not leaked)
            for sink in self.sinks:
                sink.close()
            raise
        if tracker is not None:
            self.sinks.append(tracker)
        self.display = Display(self._outputs["console"], self._outputs["live"],
                               self._outputs["total"], self._outputs["print_every"])
        also = [name for name, sink in (("TensorBoard", board), ("W&B", tracker)) if sink]
        estimate = ", an estimate (shown as MFU ~x%)" if self.peak.assumed else ""
        self.display.note(f"monitor: {self.out / METRICS}"
                          f"{''.join(f' and {name}' for name in also)}; MFU = the "
                          f"plan's FLOPs per step / ({self.peak.devices} device(s) x "
                          f"{self.peak.what}){estimate}")

    def _run_config(self) -> dict[str, Any]:
        """What a tracker shows as the run's configuration: the plan's choices."""
        plan = self.pipe.plan
        return {"layout": self._layout(), "schedule": plan.schedule.name,
                "stages": plan.stages, "data_parallel": plan.data_parallel,
                "micro_batch_size": plan.micro_batch_size,
                "num_micro_batches": plan.num_micro_batches,
                "predicted_step_seconds": plan.predicted_step_time}

    def _close_outputs(self) -> None:
        if self.display is not None:
            self.display.close()
        for sink in self.sinks:
            sink.close()
        self.display, self.sinks = None, []

    def _group(self) -> Any:
        """The monitor's own gloo group (None in one process), made on first use: every rank
        reaches its first gather at the same step, also a process that joined an in-place job
        (an eager one would wait in its constructor for ranks busy in their step)."""
        if self.distributed and self.group is None:
            timeout = self.pipe.runtime.timeout or 300.0
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        return self.group

    def _follow_morphs(self) -> None:
        """After an in-place morph (``pipe.morphs`` grew during the step being logged): the
        old generation's groups are gone (the monitor's too), this process's rank, the world
        and the devices for MFU may have changed, and the loop's time since the last log holds
        the morph's stall, so this step's rates are over ``pipe.step``'s own time. Rank 0
        logs each morph as an event (``morph_event``); a process that became rank 0 (rank 0
        left) takes over the outputs."""
        morphs = list(self.pipe.morphs)
        if len(morphs) <= self._morphs_seen:
            return
        new, self._morphs_seen = morphs[self._morphs_seen:], len(morphs)
        self.group, self._logged_at = None, None
        self.peak = peak_of(self.pipe, self._peak_flops)
        was = self.rank
        if self.distributed:
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.rank == 0 and was != 0:
            self._open_outputs(self.step)
        elif self.rank != 0 and was == 0:
            self._close_outputs()
        if self.rank != 0:
            return
        assert self.display is not None
        for morph in new:
            event = morph_event(morph.as_dict(), self.step + 1)
            for sink in self.sinks:
                sink.write_event(event)
            self.events.append(event)
            self.display.note(describe_morph(event))

    def event(self, event: dict[str, Any], text: str) -> None:
        """Rank 0: ``event`` (plain data with ``"event"`` and ``"step"`` keys) as a line of
        metrics.jsonl that is not a step's record, and ``text`` on the console (the train
        command's restart of an in-place job). Other ranks: nothing."""
        if self.rank != 0:
            return
        for sink in self.sinks:
            if isinstance(sink, JsonlSink):  # (TensorBoard takes numbers per step only)
                sink.write_event(event)
        self.events.append(event)  # the live charts mark it as the report does
        assert self.display is not None
        self.display.note(text)

    # -- per step ------------------------------------------------------------------------------

    def log(self, loss: Any = None, step: int | None = None,
            **scalars: float) -> dict[str, Any] | None:
        """Record the last ``pipe.step`` (call after it, on every rank); ``scalars`` (e.g.
        ``lr=``) are written beside. Returns the record on rank 0, else None."""
        stats = self.pipe.last_step
        if stats is None or stats is self._last:
            raise InputError("Monitor.log: no pipe.step since the last log: call it once after "
                             "every step")
        self._last = stats
        self._follow_morphs()
        now = time.perf_counter()
        loop = now - self._logged_at if self._logged_at is not None else None
        self._logged_at = now
        self.step = self.step + 1 if step is None else step
        gathered = self._gather_totals() if self.step % self.memory_every == 0 else None
        if self.rank != 0:
            return None
        record = self._record(stats, loss, loop, scalars)
        if gathered is not None:
            record["peak_memory_per_rank"], record["bytes_sent_per_rank"] = gathered
        self.records.append(record)
        for sink in self.sinks:
            sink.write(record)
        assert self.display is not None
        self.display.show(record)
        return record

    def _record(self, stats: StepStats, loss: Any, loop: float | None,
                scalars: dict[str, float]) -> dict[str, Any]:
        seconds = loop if loop is not None and loop > 0 else stats.seconds
        tokens = stats.tokens if self.tokens_per_sample is None \
            else stats.samples * self.tokens_per_sample
        record: dict[str, Any] = {
            "step": self.step,
            "loss": finite(float(loss)) if loss is not None else None,
            "step_seconds": stats.seconds,
            "loop_seconds": loop,
            "predicted_step_seconds": stats.predicted_seconds,
            "samples": stats.samples,
            "samples_per_second": stats.samples / seconds,
            "tokens_per_second": tokens / seconds if tokens is not None else None,
            "mfu": finite(self.peak.mfu(step_flops(self.pipe.plan, stats.samples), seconds)),
            **({"mfu_assumed_peak": self.peak.flops} if self.peak.assumed else {}),
            "peak_memory": stats.peak_memory,
            "bytes_sent": stats.bytes_sent,
            "time": time.time(),
        }
        for key, value in scalars.items():
            record[key] = finite(float(value))
        if not self._layout_said:  # (the layouts after a morph: its event's)
            record["layout"], self._layout_said = self._layout(), True
        return record

    def _gather_totals(self) -> tuple[list[int], list[int]] | None:
        """Every rank's peak memory and bytes sent so far, on rank 0 (collective)."""
        stats = self.pipe.last_step
        mine = (int(stats.peak_memory) if stats is not None else 0, SENT.total)
        group = self._group()
        if group is None:
            return [mine[0]], [mine[1]]
        every: list[Any] = [None] * self.world if self.rank == 0 else None  # type: ignore[assignment]
        dist.gather_object(mine, every, dst=0, group=group)
        if self.rank != 0:
            return None
        return [m for m, _ in every], [b for _, b in every]

    # -- charts and the end --------------------------------------------------------------------

    def charts(self) -> list[Path]:
        """Draw the charts now (collective: every rank sends its last step's timeline);
        returns the files written (rank 0; [] elsewhere, or without matplotlib)."""
        stats = self.pipe.last_step
        mine = stats.timeline if stats is not None else []
        group = self._group()
        if group is not None:
            every: list[Any] = [None] * self.world if self.rank == 0 else None  # type: ignore[assignment]
            dist.gather_object(mine, every, dst=0, group=group)
        else:
            every = [mine]
        if self.rank != 0:
            return []
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            assert self.display is not None
            self.display.note("monitor: no charts (matplotlib is not installed: pip install "
                              "'varuna_fx[charts]')")
            return []
        folder = self.out / CHARTS
        folder.mkdir(exist_ok=True)
        written = []
        if self.records:
            written.append(training_chart(self.records, folder / "training.png", self.events,
                                          marks(self.events)))
        if stats is not None:
            written.append(timeline_chart(self.pipe.plan, self._rows(every), folder /
                                          "timeline.png", self.step))
        return written

    def _rows(self, every: list[Any]) -> list[tuple[str, list[Any]]]:
        """Row labels and actions: per rank, or per stage in one process."""
        if not self.distributed:
            stages = sorted({a.stage for a in every[0]})
            return [(f"stage {s}", [a for a in every[0] if a.stage == s]) for s in stages]
        placement = self.pipe.plan.placement
        rows = []
        for rank, actions in enumerate(every):
            stage, replica = placement.coords(rank) if placement is not None else (rank, 0)
            rows.append((f"rank {rank}: stage {stage}, replica {replica}", actions or []))
        return rows

    def close(self) -> list[Path]:
        """Gather the final peak memory per rank, draw the charts and close the sinks
        (collective). Returns the chart files (rank 0)."""
        if self._closed:
            return []
        self._closed = True
        gathered = self._gather_totals()
        written = self.charts() if self.draw_at_close and self.pipe.last_step is not None \
            else []
        if self.rank == 0:
            assert self.display is not None
            if self.records and self.display.shown != self.records[-1]["step"]:
                self.display.show(self.records[-1], force=True)  # the last step, always
            self.display.close()
            if gathered is not None and self.records:
                memory, sent = (", ".join(format_bytes(b) for b in x) for x in gathered)
                self.display.note(f"monitor: peak memory per rank {memory}; bytes sent per "
                                  f"rank since the start {sent}")
            if written:
                self.display.note(f"monitor: charts in {self.out / CHARTS}")
            for sink in self.sinks:
                sink.close()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
        return written

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        elif self.rank == 0:  # an error: no collective (peers may be gone); keep what was logged
            self._closed = True  # (also a process leaving an in-place job: SystemExit)
            self._close_outputs()
