"""``varuna-fx plan``: the planner's choice for a model factory and a described cluster."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table

from ..cluster import Cluster
from ..errors import VarunaFxError
from ..factory import load_factory
from ..plan import _bytes, _seconds, alternatives_table
from .analyze import analyze, plan_for
from .search import Candidate, SearchResult


def cluster_from_args(args: argparse.Namespace) -> Cluster:
    return Cluster(
        gpus=args.gpus, gpus_per_node=args.gpus_per_node, gpu_memory=args.gpu_memory,
        intra_node_bandwidth=args.intra_node_bandwidth,
        inter_node_bandwidth=args.inter_node_bandwidth, device=args.device,
        device_type=getattr(args, "device_type", None), flops=getattr(args, "flops", None),
        latency=getattr(args, "latency", 0.0),
    )


def plan_command(args: argparse.Namespace) -> int:
    console = Console()
    made = load_factory(args.model)()
    model, inputs = made[0], made[1]
    try:
        cluster = cluster_from_args(args)
        graph = analyze(model, inputs, getattr(args, "tracer", "auto"))
        profile = graph.profile() if getattr(args, "profile", False) else None
        result = plan_for(
            graph, cluster, global_batch_size=args.global_batch_size,
            stages=getattr(args, "stages", None),
            data_parallel=getattr(args, "data_parallel", None),
            micro_batch_size=getattr(args, "micro_batch_size", None), schedule=args.schedule,
            recompute=not getattr(args, "no_recompute", False), profile=profile,
            top=getattr(args, "top", 5),
        )
    except VarunaFxError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 1
    console.print(describe(cluster, graph.model_name, result, profile is not None,
                           graph.seconds))
    console.print(alternatives_table(result.alternatives, f"{graph.model_name} on {cluster.gpus}"
                                     f" x {cluster.kind} ({args.schedule} schedule)"))
    console.print(stage_table(result.best))
    return 0


def describe(cluster: Cluster, name: str, result: SearchResult, measured: bool,
             seconds: dict[str, float]) -> str:
    best = result.best
    costs = "measured profile" if measured else f"FLOP estimates for {cluster.spec.name} " \
        f"({cluster.spec.flops / 1e12:.0f} TFLOP/s sustained)"
    return (
        f"[bold]{name}[/bold]: P={best.stages} x D={best.data_parallel}, micro-batch "
        f"{best.micro_batch_size} x {best.num_micro_batches}, predicted step "
        f"{_seconds(best.step_time)}\n"
        f"cluster: {cluster.gpus} devices, {cluster.gpus_per_node} per node, "
        f"{_bytes(float(cluster.gpu_memory))} each; costs from {costs}\n"
        f"search: {result.considered} candidates, {result.partitioned} partitioned, "
        f"{result.simulated} simulated in {result.seconds:.2f} s (capture and annotation "
        f"{seconds.get('capture+annotate', 0):.2f} s)"
    )


def stage_table(best: Candidate) -> Table:
    plan = best.plan
    assert plan is not None
    table = Table(title=f"stages of the chosen configuration (per micro-batch of "
                        f"{best.micro_batch_size})")
    for column in ("stage", "forward", "recompute", "backward", "sends", "weights+opt",
                   "memory"):
        table.add_column(column, justify="right")
    rows: list[Any] = list(range(plan.num_stages))
    if len(rows) > 12:  # long pipelines: the ends and the slowest stage
        slow = int((plan.forward + plan.backward).argmax())
        rows = sorted({0, 1, 2, slow, len(rows) - 3, len(rows) - 2, len(rows) - 1})
    for s in rows:
        send = _bytes(float(plan.send_bytes[s])) if s < plan.num_stages - 1 else "-"
        memory = _bytes(best.memory[s]) if best.memory else "-"
        table.add_row(str(s), _seconds(float(plan.forward[s])),
                      _seconds(float(plan.recompute[s])), _seconds(float(plan.backward[s])),
                      send, _bytes(float(plan.weights[s])), memory)
    return table
