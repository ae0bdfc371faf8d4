"""Cost of watching a run: ``pipe.last_step`` (always on), its action timeline, and
``vf.Monitor.log`` (JSONL, TensorBoard when installed, the line), against the step itself.

Run: ``python bench/bench_monitor.py`` (``--steps N``). One process, GPT at P=2 with 4
micro-batches (a small step: the worst case for a fixed per-step cost), and a 4x wider one.
Two ways, since wall clock on a shared machine is noise:

* direct: the CPU seconds spent inside ``Monitor.log`` and inside the step meter (``start`` +
  ``finish``) per step, over the median bare step's CPU seconds -- what watching adds, measured
  where it happens (the timeline's appends inside the step are not in it: see A/B);
* A/B: steps interleaved (bare: no timeline, no monitor / watched: timeline and monitor), the
  median CPU time per step of each and their ratio.
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig, lm_loss


def case(width: int) -> tuple[vf.Pipeline, torch.Tensor]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=width)
    x = torch.randint(0, cfg.vocab_size, (8, cfg.block_size))
    pipe = vf.compile(GPT(cfg), vf.Cluster(gpus=2, device="cpu"), (x,), loss_fn=lm_loss,
                      stages=2, micro_batch_size=2, schedule="1f1b")
    return pipe, x


class Timed:
    """Wraps a bound method, adding the process's CPU seconds during it to ``total`` (CPU
    time, unlike wall time, does not count the moments another job had the core)."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.total = fn, 0.0

    def __call__(self, *a: Any, **k: Any) -> Any:
        began = time.process_time()
        try:
            return self.fn(*a, **k)
        finally:
            self.total += time.process_time() - began


def measure(width: int, steps: int) -> dict[str, float]:
    pipe, x = case(width)
    out = tempfile.mkdtemp()
    monitor = vf.Monitor(pipe, out, live=False, print_every=10,
                         console=Console(file=io.StringIO()), charts=False)
    for _ in range(3):  # warm up both paths
        pipe.step(x, target=x)
        monitor.log(0.0)
    meter = pipe._meter
    start, finish, log = Timed(meter.start), Timed(meter.finish), Timed(monitor.log)
    meter.start, meter.finish, monitor.log = start, finish, log  # type: ignore[method-assign]
    cpu: dict[bool, list[float]] = {False: [], True: []}
    wall: list[float] = []
    watched_steps = 0
    for k in range(2 * steps):
        watched = k % 2 == 1
        meter.record_timeline = watched
        began, began_wall = time.process_time(), time.perf_counter()
        loss = pipe.step(x, target=x)
        if watched:
            monitor.log(loss)
            watched_steps += 1
        cpu[watched].append(time.process_time() - began)
        wall.append(time.perf_counter() - began_wall)
    monitor.close()
    step = statistics.median(cpu[False])
    return {"width": width, "step_ms": step * 1e3, "wall_ms": statistics.median(wall) * 1e3,
            "log_us": log.total / watched_steps * 1e6,
            "meter_us": (start.total + finish.total) / (2 * steps) * 1e6,
            "direct": (log.total / watched_steps + (start.total + finish.total) / (2 * steps))
            / step,
            "ab": statistics.median(cpu[True]) / statistics.median(cpu[False]) - 1,
            "records": len(pipe.last_step.timeline)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    table = Table(title="cost of watching (one process, GPT P=2, 4 micro-batches; CPU times)")
    for col in ("n_embd", "step CPU (wall)", "Monitor.log", "step meter", "direct overhead",
                "A/B CPU (watched/bare - 1)", "timeline records"):
        table.add_column(col, justify="right")
    for width in (64, 256):
        r = measure(width, args.steps)
        table.add_row(str(r["width"]), f"{r['step_ms']:.1f} ms ({r['wall_ms']:.1f} ms)",
                      f"{r['log_us']:.0f} us",
                      f"{r['meter_us']:.0f} us", f"{r['direct']:.2%}", f"{r['ab']:+.2%}",
                      str(r["records"]))
    Console().print(table)


if __name__ == "__main__":
    from results import recorded

    with recorded("bench_monitor.py"):
        main()
