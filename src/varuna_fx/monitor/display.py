"""The monitor's line on rank 0: a live line with a progress bar on a terminal (rich), plain
lines when the output goes to a file or a pipe.

The live line is redrawn at most every ``REFRESH`` seconds and never from a thread of its own
(a rendering thread would contend for the GIL with the training loop), so a step costs a few
microseconds when no redraw is due; plain lines are written to the console's file as they are.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from ..costs.memory import format_bytes
from .flops import flops_text

REFRESH = 1.0  # seconds between redraws of the live line (a redraw: about a millisecond)


def describe(record: dict[str, Any], total: int | None) -> str:
    """The one-line summary of a record: step, loss, time against the plan, throughput, MFU,
    memory and bytes sent."""
    parts = [f"step {record['step']}" + (f"/{total}" if total else ""),
             f"loss {record['loss']:.4f}" if record.get("loss") is not None else "loss -",
             f"{record['step_seconds'] * 1e3:.1f} ms/step"]
    if record.get("predicted_step_seconds"):
        parts[-1] += f" (plan {record['predicted_step_seconds'] * 1e3:.1f} ms)"
    if record.get("tokens_per_second") is not None:
        parts.append(f"{record['tokens_per_second']:,.0f} tok/s")
    parts.append(f"{record['samples_per_second']:,.1f} samples/s")
    if record.get("mfu") is not None:
        parts.append(mfu_text(record))
    memory = record.get("peak_memory_per_rank") or [record.get("peak_memory", 0)]
    parts.append(f"peak mem {format_bytes(max(memory))}")
    parts.append(f"sent {format_bytes(record.get('bytes_sent', 0))}/step")
    return " | ".join(parts)


def mfu_text(record: dict[str, Any]) -> str:
    """``MFU 41.2%`` against a datasheet's (or the user's) peak; against an assumed one (every
    CPU: no datasheet figure) ``MFU ~1.2% (est., peak 100 GFLOP/s assumed)``,
    so a CPU's percentage is not read as a measured utilisation."""
    assumed = record.get("mfu_assumed_peak")
    if not assumed:
        return f"MFU {record['mfu']:.1%}"
    return f"MFU ~{record['mfu']:.1%} (est., peak {flops_text(assumed)} assumed)"


class Display:
    """``live`` None: a live line when ``console`` is a terminal, else plain lines."""

    def __init__(self, console: Console | None, live: bool | None, total: int | None,
                 print_every: int) -> None:
        self.console = console or Console()
        self.total, self.print_every = total, print_every
        self.live_mode = self.console.is_terminal if live is None else live
        self._live: Live | None = None
        self._drawn = 0.0
        self.shown: int | None = None  # the step last printed or drawn

    def note(self, text: str) -> None:
        """A line said once (the header, where charts went)."""
        if self._live is not None:
            self._live.console.print(text, highlight=False)
        else:
            self.console.print(text, highlight=False, soft_wrap=True)

    def show(self, record: dict[str, Any], force: bool = False) -> None:
        if not self.live_mode:
            step = record["step"]
            if force or step % self.print_every == 0 or step == self.total:
                # written as it is: rich's print measures the terminal each time (milliseconds)
                self.console.file.write(describe(record, self.total) + "\n")
                self.console.file.flush()
                self.shown = step
            return
        now = time.monotonic()
        if not force and now - self._drawn < REFRESH:
            return
        self._drawn, self.shown = now, record["step"]
        if self._live is None:
            self._live = Live(console=self.console, auto_refresh=False, transient=False)
            self._live.start()
        self._live.update(self._render(record), refresh=True)

    def _render(self, record: dict[str, Any]) -> Table:
        grid = Table.grid(padding=(0, 1))
        if self.total:
            grid.add_row(ProgressBar(total=self.total, completed=record["step"], width=30),
                         Text(describe(record, self.total)))
        else:
            grid.add_row(Text(describe(record, self.total)))
        return grid

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
