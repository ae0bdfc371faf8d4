"""Planner speed: the full (P, D, micro-batch) search for a 48-layer, d=1024 GPT on 1024 GPUs.

Run: ``python bench/bench_planner.py`` (``--global-batch-size``, ``--schedule``, ``--gpu-memory``,
``--inter-node-bandwidth`` and ``--device-type`` vary the setting). The model is built on the
meta device (capture and annotation use fake tensors), so nothing large is allocated. Capture
and annotation are timed apart from the search; the search is timed cold (fresh planner, no
cached partitions or schedules). Target: <= 2 s for the search. ``--schedule auto`` lets the
planner weigh every schedule per candidate (the "schedule" column says which it chose).

``--repeat N`` searches N times (each cold: a fresh planner, the generators' caches cleared) and
reports every time and the least, wall and CPU (``time.process_time``, steadier on a shared
machine). ``--json PATH`` writes the chosen configuration and the alternatives rows, floats
exactly (``repr``), to compare two trees' choices: run this script with each tree's ``src`` on
``PYTHONPATH`` and diff the files.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import statistics
import time

import torch
from rich.console import Console

import varuna_fx as vf
import varuna_fx.schedule as schedules
from varuna_fx.capture.inputs import bind_inputs
from varuna_fx.capture.trace import capture
from varuna_fx.examples import GPT, GPTConfig
from varuna_fx.launch.plan_command import stage_table
from varuna_fx.planner import CostTable, Planner, Space, analyze
from varuna_fx.planner.plan import alternatives_table
from varuna_fx.schedule import varuna as varuna_orders

CFG = GPTConfig(n_layer=48, n_embd=1024, n_head=16, vocab_size=50257, block_size=1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--global-batch-size", type=int, default=1024)
    parser.add_argument("--schedule", default="varuna")
    parser.add_argument("--gpu-memory", default="16GiB")
    parser.add_argument("--inter-node-bandwidth", default="10Gbit/s")
    parser.add_argument("--device-type", default=None)
    parser.add_argument("--devices", type=int, default=1024, help="GPUs in the cluster")
    parser.add_argument("--profile", default=None,
                        help="write a cProfile of the (last) search here (pstats format)")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the chosen rows here")
    args = parser.parse_args()
    console = Console(width=150)

    start = time.perf_counter()
    with torch.device("meta"):
        model = GPT(CFG)
    built = time.perf_counter() - start
    tokens = torch.zeros(8, CFG.block_size, dtype=torch.long)
    start = time.perf_counter()
    capture(model, bind_inputs(model, (tokens,)), "auto")  # alone, to split the time below
    captured = time.perf_counter() - start
    graph = analyze(model, (tokens,))
    start = time.perf_counter()
    table = CostTable.build(graph.gm)
    tabled = time.perf_counter() - start

    cluster = vf.Cluster(gpus=args.devices, gpus_per_node=8, gpu_memory=args.gpu_memory,
                         inter_node_bandwidth=args.inter_node_bandwidth,
                         device_type=args.device_type)
    walls, cpus = [], []
    for _ in range(max(1, args.repeat)):
        cold()
        planner = Planner(table, cluster, schedule=args.schedule, recompute=True)
        cpu = time.process_time()
        space = Space(cluster.gpus, 8, args.global_batch_size)
        if args.profile:
            profiler = cProfile.Profile()
            result = profiler.runcall(planner.search, space, top=args.top)
            profiler.dump_stats(args.profile)
        else:
            result = planner.search(space, top=args.top)
        cpus.append(time.process_time() - cpu)
        walls.append(result.seconds)
    best = result.best

    params = sum(p.numel() for p in model.parameters())
    console.print(
        f"GPT 48 x 1024 ({params / 1e6:.0f} M parameters, {len(table.names)} operations, "
        f"{table.num_units} cut units) on {cluster.gpus} x {cluster.kind} "
        f"({cluster.gpus_per_node} per node, {args.gpu_memory}, inter-node "
        f"{args.inter_node_bandwidth}), global batch {args.global_batch_size}, "
        f"{args.schedule} schedule"
    )
    console.print(
        f"build (meta) {built:.2f} s | capture {captured:.2f} s | annotate "
        f"{graph.seconds['capture+annotate'] - captured:.2f} s | cost table {tabled:.2f} s | "
        "[bold]search "
        f"{min(walls):.2f} s[/bold] ({result.considered} candidates, "
        f"{result.partitioned} partitioned, {result.simulated} simulated)"
    )
    if len(walls) > 1:
        console.print(
            f"{len(walls)} cold searches: wall {', '.join(f'{t:.2f}' for t in walls)} s "
            f"(least {min(walls):.2f}, median {statistics.median(walls):.2f}); CPU "
            f"{', '.join(f'{t:.2f}' for t in cpus)} s (least {min(cpus):.2f})"
        )
    console.print(f"chosen: P={best.stages} D={best.data_parallel} micro-batch "
                  f"{best.micro_batch_size} x {best.num_micro_batches}")
    console.print(alternatives_table(result.alternatives, "top configurations"))
    console.print(stage_table(best))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows(result.alternatives, list(best.plan.bounds)), f, indent=1)


def cold() -> None:
    """Forget what the schedule generators cached, so that each repeat searches cold (a tree
    older than ``clear_caches`` kept only Varuna's order memo)."""
    clear = getattr(schedules, "clear_caches", None)
    if clear is not None:
        clear()
    else:
        varuna_orders._MEMO.clear()


def rows(alternatives: list, bounds: list[int]) -> dict:
    """The alternatives rows (floats as ``repr``, so equal text means equal bits) and the
    chosen partition's bounds."""
    return {
        "bounds": bounds,
        "rows": [[a.stages, a.data_parallel, a.micro_batch_size, a.num_micro_batches,
                  repr(a.step_time), repr(a.bubble_fraction), repr(a.allreduce_time),
                  [repr(x) for x in a.stage_memory], a.chosen, a.schedule]
                 for a in alternatives],
    }


if __name__ == "__main__":
    from results import recorded

    with recorded("bench_planner.py"):
        main()
