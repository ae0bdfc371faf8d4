"""Simulator accuracy: predicted vs measured step time of real runs on this machine.

Run: ``python bench/bench_sim_accuracy.py`` (``--steps``, ``--global-batch-size``). It launches

1. ``torch.distributed.run --standalone --nproc-per-node 2`` (gloo, OMP_NUM_THREADS=1): every
   rank joins, rank 0 profiles the model (one thread: CPU-time clock) and broadcasts it, a
   ping-pong and an all-reduce measure the network, the planner picks its configuration for
   "2 CPU processes" (over both schedules), then every two-process configuration -- P=1 x D=2
   and P=2 x D=1 under varuna and 1f1b, at two micro-batch sizes -- compiles with that profile
   and is timed (warm-up, then the median of ``--steps`` steps);
2. one process (OMP_NUM_THREADS=1) for P=1 x D=1 at the same micro-batch sizes, predicted from
   the same cached profile. (P=2 in one process is not a real pipeline and is not counted.)

This machine is shared, and other jobs only ever add time, so every configuration is timed in
``--rounds`` sweeps and keeps the median step of its least disturbed sweep; ``spread`` is the
range of its sweeps' medians (over the least), how much the load moved it.

It prints a table of predicted vs measured step time with the error of each, the median and
worst error, and whether the planner's choice was the measured fastest (or within 5%).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

MODEL = {"n_layer": 4, "n_embd": 256, "n_head": 4, "block_size": 64, "vocab_size": 512}
SIZES = (2, 8)


class LanguageModel(torch.nn.Module):
    """GPT returning its own loss (as HF models do), so the loss is part of the profiled
    graph; an external ``loss_fn`` is not measured by the profiler."""

    def __init__(self) -> None:
        super().__init__()
        from varuna_fx.examples import GPT, GPTConfig

        self.gpt = GPT(GPTConfig(**MODEL))  # type: ignore[arg-type]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from varuna_fx.examples import lm_loss

        return lm_loss(self.gpt(idx), targets)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return LanguageModel()


def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, MODEL["vocab_size"], (n, MODEL["block_size"] + 1),
                           generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def time_config(p: int, d: int, b: int, schedule: str, global_batch: int, steps: int,
                barrier: Any = None) -> dict[str, Any]:
    """Compile (with the cached profile) and time ``steps`` training steps."""
    import varuna_fx as vf

    x, y = batch(global_batch // d)
    pipe = vf.compile(make_model(), example_inputs=(x, y), global_batch_size=global_batch,
                      stages=p, data_parallel=d, micro_batch_size=b, schedule=schedule,
                      profile=True)
    times, cpu = [], []
    for i in range(steps + 2):
        if barrier is not None:
            barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        pipe.step(x, y)
        if i >= 2:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    close = getattr(pipe.runtime, "close", None)
    if close is not None:
        close()
    return {"P": p, "D": d, "b": b, "m": global_batch // d // b, "schedule": schedule,
            "predicted": pipe.plan.predicted_step_time, "measured": statistics.median(times),
            "cpu": statistics.median(cpu)}


def choose(global_batch: int) -> dict[str, Any]:
    """The planner's pick for two CPU processes, over both schedules (measured profile and
    network)."""
    import varuna_fx as vf
    from varuna_fx.planner import analyze, plan_for

    graph = analyze(make_model(), batch(global_batch))
    profile = graph.profile()
    cluster = vf.Cluster.local()
    best = None
    for schedule in ("varuna", "1f1b"):
        top = plan_for(graph, cluster, global_batch_size=global_batch, schedule=schedule,
                       profile=profile).best
        if best is None or top.step_time < best["predicted"]:
            best = {"P": top.stages, "D": top.data_parallel, "b": top.micro_batch_size,
                    "schedule": schedule, "predicted": top.step_time}
    assert best is not None
    net = profile.network
    best["network"] = None if net is None else {
        "latency_us": net.latency * 1e6, "bandwidth_GBps": net.bandwidth / 1e9,
        "allreduce_latency_us": net.allreduce_latency * 1e6,
        "allreduce_bandwidth_GBps": net.allreduce_bandwidth / 1e9}
    return best


def worker(args: argparse.Namespace) -> None:
    """One rank of the two-process launch."""
    import torch.distributed as dist

    from varuna_fx.world.where import init_process_group

    init_process_group(600.0)
    rank = dist.get_rank()
    chosen = choose(args.global_batch_size)
    configs = [(1, 2, b, "varuna") for b in SIZES]
    configs += [(2, 1, b, s) for s in ("varuna", "1f1b") for b in SIZES]
    pick = (chosen["P"], chosen["D"], chosen["b"], chosen["schedule"] if chosen["P"] > 1
            else "varuna")
    if chosen["P"] * chosen["D"] == 2 and pick not in configs:
        configs.append(pick)
    rows = rounds(args, [lambda p=p, d=d, b=b, s=s: time_config(
        p, d, b, s, args.global_batch_size, args.steps, dist.barrier) for p, d, b, s in configs])
    if rank == 0:
        Path(args.out).write_text(json.dumps({"rows": rows, "chosen": chosen}))
    dist.barrier()
    dist.destroy_process_group()


def single(args: argparse.Namespace) -> None:
    sizes = sorted({*SIZES, *([args.extra] if args.extra else [])})
    rows = rounds(args, [lambda b=b: time_config(1, 1, b, "varuna", args.global_batch_size,
                                                 args.steps) for b in sizes])
    Path(args.out).write_text(json.dumps({"rows": rows}))


def rounds(args: argparse.Namespace, runs: list[Any]) -> list[dict[str, Any]]:
    """Every configuration timed in ``--rounds`` sweeps; each keeps its least disturbed sweep
    (other jobs on this shared 2-core machine come in bursts and only ever add time)."""
    best: list[dict[str, Any]] = []
    seen: list[list[float]] = [[] for _ in runs]
    for r in range(args.rounds):
        for i, run in enumerate(runs):
            row = run()
            seen[i].append(row["measured"])
            if r == 0:
                best.append(row)
            elif row["measured"] < best[i]["measured"]:
                best[i] = row
    for row, sweeps in zip(best, seen):  # how far the sweeps' medians moved: the noise
        row["spread"] = (max(sweeps) - min(sweeps)) / min(sweeps)
    return best


def launch(args: argparse.Namespace) -> None:
    console = Console(width=120)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.setdefault("VARUNA_FX_CACHE_DIR", tempfile.mkdtemp(prefix="varuna_fx_profiles_"))
    me = os.path.abspath(__file__)
    common = ["--steps", str(args.steps), "--global-batch-size", str(args.global_batch_size),
              "--rounds", str(args.rounds)]
    with tempfile.TemporaryDirectory() as tmp:
        out2, out1 = os.path.join(tmp, "two.json"), os.path.join(tmp, "one.json")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", me, "--worker", "--out", out2, *common],
                       env=env, check=True)
        two = json.loads(Path(out2).read_text())
        chosen = two["chosen"]
        extra = ["--extra", str(chosen["b"])] if chosen["P"] * chosen["D"] == 1 else []
        subprocess.run([sys.executable, me, "--single", "--out", out1, *common, *extra],
                       env=env, check=True)
        rows = json.loads(Path(out1).read_text())["rows"] + two["rows"]
    report(console, rows, chosen, args)


def report(console: Console, rows: list[dict[str, Any]], chosen: dict[str, Any],
           args: argparse.Namespace) -> None:
    table = Table(title=f"predicted vs measured step time (GPT {MODEL}, global batch "
                        f"{args.global_batch_size}, CPU, gloo, 1 thread per process)")
    for column in ("P", "D", "micro-batch", "schedule", "predicted", "measured", "spread",
                   "error", "rank-0 CPU", ""):
        table.add_column(column, justify="right")
    errors = []
    fastest = min(r["measured"] for r in rows)
    key = (chosen["P"], chosen["D"], chosen["b"])
    for r in rows:
        error = r["predicted"] / r["measured"] - 1
        errors.append(abs(error))
        is_chosen = (r["P"], r["D"], r["b"]) == key and (r["P"] == 1 or
                                                         r["schedule"] == chosen["schedule"])
        table.add_row(str(r["P"]), str(r["D"]), f"{r['b']} x {r['m']}", r["schedule"],
                      f"{r['predicted'] * 1e3:.1f} ms", f"{r['measured'] * 1e3:.1f} ms",
                      f"{r.get('spread', 0.0):.1%}", f"{error:+.1%}", f"{r['cpu'] * 1e3:.1f} ms",
                      ("chosen " if is_chosen else "")
                      + ("fastest" if r["measured"] == fastest else ""))
    console.print(table)
    console.print(f"median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%} "
                  f"over {len(rows)} configurations")
    picked = [r for r in rows if (r["P"], r["D"], r["b"]) == key
              and (r["P"] == 1 or r["schedule"] == chosen["schedule"])]
    if picked:
        gap = picked[0]["measured"] / fastest - 1
        console.print(f"planner's choice P={key[0]} D={key[1]} micro-batch {key[2]} "
                      f"({chosen['schedule']}): measured {gap:+.1%} vs the fastest")
    console.print(f"network (ping-pong / all-reduce, gloo): {chosen.get('network')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="sweeps; each config keeps its "
                        "fastest sweep's median step")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--extra", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
    elif args.single:
        single(args)
    else:
        launch(args)


if __name__ == "__main__":
    from results import recorded

    with recorded("bench_sim_accuracy.py"):
        main()
