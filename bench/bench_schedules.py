"""Compare Varuna, 1F1B and GPipe schedules in simulation, and time the simulator.

Run: ``python bench/bench_schedules.py``. Prints a table of simulated step times (all schedules
with recompute; F=1, R=1, B=2 time units per micro-batch per stage; every boundary transfer
costs 0.1 of a forward, expressed as 1e8 bytes over 1e9 bytes/s), the simulator's throughput,
and saves a stacked Gantt chart of the three schedules for P=4, m=8 under bench/figures/.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
try:
    import varuna_fx.schedule  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(HERE.parent / "src"))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from varuna_fx.schedule import (  # noqa: E402
    ScheduleCosts,
    SimResult,
    build_schedule,
    gantt,
    simulate,
    simulate_costs,
)

NAMES = ["varuna", "1f1b", "gpipe"]
FWD, REC, BWD = 1.0, 1.0, 2.0
SEND_BYTES, BANDWIDTH = 1e8, 1e9  # 0.1 time units per boundary crossing


def run(name: str, p: int, m: int) -> SimResult:
    sched = build_schedule(name, p, m, recompute=True)
    return simulate(
        sched,
        forward=[FWD] * p,
        backward=[BWD] * p,
        recompute=[REC] * p,
        send_bytes=[SEND_BYTES] * (p - 1),
        bandwidth=BANDWIDTH,
    )


def comparison_table() -> Table:
    table = Table(title="Simulated step time (recompute on; F=1 R=1 B=2, send 0.1)")
    for col in ["P", "m", "schedule", "step time", "vs gpipe", "bubble", "peak stash @0"]:
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for p in (4, 8):
        for m in (8, 32):
            results = {name: run(name, p, m) for name in NAMES}
            base = results["gpipe"].step_time
            for name, res in results.items():
                table.add_row(
                    str(p),
                    str(m),
                    name,
                    f"{res.step_time:.1f}",
                    f"{res.step_time / base:.3f}",
                    f"{res.bubble_fraction:.1%}",
                    str(res.peak_stash_count[0]),
                )
            table.add_section()
    return table


def sims_per_second(name: str, p: int, m: int, seconds: float = 1.0) -> float:
    """Throughput of repeated simulate() calls on one (already compiled) schedule."""
    sched = build_schedule(name, p, m, recompute=True)
    fwd, bwd, send = [FWD] * p, [BWD] * p, [SEND_BYTES] * (p - 1)
    simulate(sched, fwd, bwd, send_bytes=send, bandwidth=BANDWIDTH)  # compile once
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(100):
            simulate(sched, fwd, bwd, send_bytes=send, bandwidth=BANDWIDTH)
        n += 100
    return n / (time.perf_counter() - start)


def save_gantt(path: Path, p: int = 4, m: int = 8) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 8.5), layout="constrained")
    axes = fig.subplots(len(NAMES), 1, sharex=True)
    for ax, name in zip(axes, NAMES):
        gantt(build_schedule(name, p, m, recompute=True), ax=ax)
        if ax is not axes[-1]:
            ax.set_xlabel("")  # the shared axis is labelled once, at the bottom
    fig.suptitle(f"P={p}, m={m}, recompute on (unit costs F=R=1, B=2, free links)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def cost_aware_table() -> Table:
    """Varuna's cost-aware order and the split-backward schedules against 1F1B (P=4), each
    generated from and simulated with the same costs (B = 2F, W = B/2; links in forwards)."""
    table = Table(title="Step time / 1F1B's, P=4 (orders generated from these costs)")
    for col in ["costs", "m", "recompute", "varuna", "1f1b-zb", "varuna-zb"]:
        table.add_column(col, justify="left" if col == "costs" else "right")
    cases = {"uniform": ([1.0] * 4, 0.0), "heavy head": ([1.0, 1.0, 1.0, 2.5], 0.0),
             "uniform, link 0.5": ([1.0] * 4, 0.5),
             "heavy head, link 0.5": ([1.0, 1.0, 1.0, 2.5], 0.5)}
    for label, (fwd, link) in cases.items():
        costs = ScheduleCosts.of(fwd, [2 * f for f in fwd], links=[link] * 3)
        for m in (4, 8):
            for rc in (True, False):
                t = {n: simulate_costs(build_schedule(n, 4, m, rc, costs), costs).step_time
                     for n in ("1f1b", "varuna", "1f1b-zb", "varuna-zb")}
                table.add_row(label, str(m), str(rc),
                              *(f"{t[n] / t['1f1b']:.3f}" for n in ("varuna", "1f1b-zb",
                                                                     "varuna-zb")))
    return table


def main() -> None:
    console = Console()
    console.print(comparison_table())
    console.print(cost_aware_table())
    for p, m in [(8, 32), (16, 64)]:
        rates = ", ".join(f"{name} {sims_per_second(name, p, m):,.0f}/s" for name in NAMES[:2])
        console.print(f"simulate() throughput at P={p}, m={m}: {rates}")
    out = HERE / "figures" / "schedules_P4_m8.png"
    save_gantt(out)
    console.print(f"Gantt chart saved to {out}")


if __name__ == "__main__":
    from results import recorded

    with recorded("bench_schedules.py"):
        main()
