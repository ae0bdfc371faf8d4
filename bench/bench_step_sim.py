"""Simulated step time of Varuna vs 1F1B vs GPipe, with realistic costs and link times.

Run: ``python bench/bench_step_sim.py``. The table is ``bench_schedules.comparison_table()``
(all with recompute; per micro-batch per stage F=1, R=F, B=2F; every boundary transfer takes
0.1 F, i.e. 1e8 bytes at 1e9 bytes/s) -- reused, not duplicated. Unlike bench_schedules' figure
(unit costs, free links) the Gantt chart saved here is drawn from the simulations with link times,
P=4 and P=8 at m=8.
"""

from __future__ import annotations

from pathlib import Path

from bench_schedules import NAMES, comparison_table, run
from matplotlib.figure import Figure
from rich.console import Console

from varuna_fx.schedule import gantt

OUT = Path(__file__).resolve().parent / "figures"


def save_gantt(p: int, m: int) -> Path:
    fig = Figure(figsize=(13, 2.2 + 0.75 * p * len(NAMES)), layout="constrained")
    axes = fig.subplots(len(NAMES), 1, sharex=True)
    for ax, name in zip(axes, NAMES):
        sim = run(name, p, m)
        gantt(sim, ax=ax, title=f"{name}: step {sim.step_time:.1f} F, "
                                f"bubble {sim.bubble_fraction:.1%}")
        ax.set_xlabel("time (units of one forward)" if ax is axes[-1] else "")
    fig.suptitle(f"P={p}, m={m}, recompute on; F=R=1, B=2, each transfer 0.1")
    path = OUT / f"step_sim_P{p}_m{m}.png"
    OUT.mkdir(exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    console = Console()
    console.print(comparison_table())
    for p in (4, 8):
        console.print(f"Gantt chart saved to {save_gantt(p, 8)}")


if __name__ == "__main__":
    from results import recorded

    with recorded("bench_step_sim.py"):
        main()
