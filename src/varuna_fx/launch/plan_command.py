"""``varuna-fx plan``: the planner's choice for a model factory and a described cluster.

It takes what ``vf.compile`` takes (schedule, stages per rank, recompute, optimizer sharding,
precision) and makes the choice compile makes with them: the command line's options become the
planner's options object (``plan_options``: ``planner/options.PlanOptions``), taken whole by
``Analyzed.plan``, so a plan printed here is the one a launched run on that cluster gets.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from ..costs.memory import format_bytes
from ..errors import VarunaFxError
from ..planner.analyze import Analyzed, analyze
from ..planner.candidates import Candidate, SearchResult
from ..planner.cluster import Cluster
from ..planner.options import PlanOptions
from ..planner.plan import (
    Alternative,
    Plan,
    _count,
    _seconds,
    alternatives_table,
    explain_pick,
    optimizer_note,
)
from ..planner.profile import Profile
from ..schedule import virtual_names
from ..train.factory import load_factory


def cluster_from_args(args: argparse.Namespace) -> Cluster:
    return Cluster(
        gpus=args.gpus, gpus_per_node=args.gpus_per_node, gpu_memory=args.gpu_memory,
        intra_node_bandwidth=args.intra_node_bandwidth,
        inter_node_bandwidth=args.inter_node_bandwidth, device=args.device,
        device_type=getattr(args, "device_type", None), flops=getattr(args, "flops", None),
        latency=getattr(args, "latency", 0.0),
    )


def plan_command(args: argparse.Namespace, console: Console | None = None) -> int:
    console = console or Console()
    made = load_factory(args.model)()
    model, inputs = made[0], made[1]
    try:
        cluster = cluster_from_args(args)
        graph = analyze(model, inputs, getattr(args, "tracer", "auto"))
        profile = graph.profile() if getattr(args, "profile", False) else None
        result = search(args, graph, cluster, profile)
        note = devices_note(args, graph, cluster, profile, result)
    except VarunaFxError as exc:
        print(f"error: {as_options(str(exc))}", file=sys.stderr)
        return 1
    if getattr(args, "json", False):
        print(json.dumps(search_as_dict(cluster, graph.model_name, result, profile is not None,
                                        note, options_as_dict(args, result)), indent=2))
        return 0
    console.print(describe(cluster, graph.model_name, result, profile is not None,
                           graph.seconds))
    console.print(options_line(args, result))
    if note:
        console.print(f"[yellow]note:[/yellow] {note}")
    console.print(alternatives_table(result.alternatives, f"{graph.model_name} on {cluster.gpus}"
                                     f" x {cluster.kind} ({args.schedule} schedule)"))
    console.print(stage_table(result.best))
    console.print(explain_pick(result.alternatives))  # what decided the pick (plan.explain)
    return 0


# compile()'s keyword arguments in the planner's messages -> the options of `varuna-fx plan`
_OPTIONS = [
    (re.compile(r"\b(global_batch_size|micro_batch_size|grad_accum_steps|data_parallel|stages)="),
     lambda m: "--" + m.group(1).replace("_", "-") + "="),
    (re.compile(r"\brecompute=True\b"), lambda m: "--recompute true"),
    (re.compile(r"\brecompute=False\b"), lambda m: "--recompute false"),
    (re.compile(r"\bstages_per_rank=(\d+)"), lambda m: f"--stages-per-rank={m.group(1)}"),
    (re.compile(r"\bshard_optimizer=(\w+)"), lambda m: f"--shard-optimizer {m.group(1).lower()}"),
]


def as_options(message: str) -> str:
    """A planner error as a command-line user can act on it: the flags, not the keywords."""
    for pattern, flag in _OPTIONS:
        message = pattern.sub(flag, message)
    return message


def plan_options(args: argparse.Namespace, cluster: Cluster, profile: Profile | None,
                 **fixed: int) -> PlanOptions:
    """The command line's constraints as the planner's options (``fixed`` overrides them)."""
    chosen = {"stages": getattr(args, "stages", None),
              "data_parallel": getattr(args, "data_parallel", None),
              "micro_batch_size": getattr(args, "micro_batch_size", None),
              "grad_accum_steps": getattr(args, "grad_accum_steps", None), **fixed}
    return PlanOptions(cluster=cluster, global_batch_size=args.global_batch_size,
                       schedule=args.schedule, recompute=recompute_setting(args),
                       profile=profile, stages_per_rank=stages_per_rank_setting(args),
                       shard_optimizer=getattr(args, "shard_optimizer", "auto"), **chosen)


def search(args: argparse.Namespace, graph: Analyzed, cluster: Cluster,
           profile: Profile | None, **fixed: int) -> SearchResult:
    """The planner's search with the command line's constraints (``fixed`` overrides them)."""
    return graph.plan(plan_options(args, cluster, profile, **fixed),
                      top=1 if fixed else getattr(args, "top", 5))


def recompute_setting(args: argparse.Namespace) -> bool | str:
    """compile's ``recompute`` from ``--recompute`` (default "auto") or ``--no-recompute``."""
    if getattr(args, "no_recompute", False):
        return False
    return getattr(args, "recompute", "auto")


def stages_per_rank_setting(args: argparse.Namespace) -> int | None:
    """compile's ``stages_per_rank``: ``--stages-per-rank`` as given ("auto": None), else the
    schedule's own (1, or None: the entry's v for a schedule of several stages per rank)."""
    given = getattr(args, "stages_per_rank", None)
    if given is not None:
        return None if given == "auto" else int(given)
    return None if args.schedule in virtual_names() else 1


def options_as_dict(args: argparse.Namespace, result: SearchResult) -> dict[str, Any]:
    """compile's options the plan was made with (JSON), and the optimizer's fate."""
    best = result.best
    shard = getattr(args, "shard_optimizer", "auto")
    return {"precision": getattr(args, "precision", "fp32"),
            "recompute": recompute_setting(args), "planned_with_recompute": result.recompute,
            "shard_optimizer": shard, "optimizer_state_priced_sharded": best.shard,
            "optimizer": optimizer_note(shard, best.data_parallel, best.shard),
            "stages_per_rank": result.stages_per_rank}


def options_line(args: argparse.Namespace, result: SearchResult) -> str:
    """compile's options the plan was made with, and what a launched run does with them."""
    best = result.best
    precision = getattr(args, "precision", "fp32")
    rc = recompute_setting(args)
    recompute = f"recompute {str(rc).lower()}" + (
        " (" + ("planned with recomputation: nothing fits without" if result.recompute
                else "planned without recomputation") + ")" if rc == "auto" else "")
    line = (f"options: precision {precision}, {recompute}, "
            f"shard_optimizer {str(getattr(args, 'shard_optimizer', 'auto')).lower()}, "
            f"stages per rank {result.stages_per_rank}")
    if precision != "fp32":
        line += (f"\n{precision}: planned from the model's own dtypes, as vf.compile plans it "
                 "(autocast's narrower activations are not priced)")
    note = optimizer_note(getattr(args, "shard_optimizer", "auto"), best.data_parallel,
                          best.shard)
    return line + (f"\n{note}" if note else "")


def devices_note(args: argparse.Namespace, graph: Analyzed, cluster: Cluster,
                 profile: Profile | None, result: SearchResult) -> str | None:
    """Why the choice leaves devices idle, when it does: the batch, or the prediction."""
    best = result.best
    ranks = best.stages // result.stages_per_rank  # of one replica
    used = ranks * best.data_parallel
    if used >= cluster.gpus or getattr(args, "data_parallel", None) is not None:
        return None
    head = f"the choice uses {used} of {cluster.gpus} devices"
    widest = cluster.gpus // ranks  # replicas of this pipeline the devices could hold
    batch = args.global_batch_size
    wider = [d for d in range(best.data_parallel + 1, widest + 1)
             if batch is None or batch % d == 0]
    if not wider:
        return (f"{head}: the global batch of {batch} samples splits over at most "
                f"{best.data_parallel} replicas of this {best.stages}-stage pipeline (D must "
                "divide it); a larger --global-batch-size lets more devices work")
    per_replica = ("" if batch is not None else
                   f" Without --global-batch-size each replica steps on the model's example "
                   f"batch of {graph.bound.batch_size} (global batch = D x "
                   f"{graph.bound.batch_size}); pass it to plan for a fixed global batch.")
    try:
        full = search(args, graph, cluster, profile, stages=best.stages,
                      data_parallel=wider[-1]).best
    except VarunaFxError:
        return f"{head}: more replicas do not fit.{per_replica}"
    return (f"{head}: P={full.stages} x D={full.data_parallel} is predicted at "
            f"{_count(full.samples / full.step_time)} samples/s, the choice at "
            f"{_count(best.samples / best.step_time)} samples/s (the all-reduce over more "
            f"replicas costs more than they add).{per_replica}")


def describe(cluster: Cluster, name: str, result: SearchResult, measured: bool,
             seconds: dict[str, float]) -> str:
    best = result.best
    costs = "measured profile" if measured else f"FLOP estimates for {cluster.spec.name} " \
        f"({_count(cluster.spec.flops)}FLOP/s sustained)"
    return (
        f"[bold]{name}[/bold]: P={best.stages} x D={best.data_parallel}"
        + (f" ({result.stages_per_rank} stages per device)" if result.stages_per_rank > 1
           else "") + f", global batch {best.samples} = micro-batch "
        f"{best.micro_batch_size} x {best.num_micro_batches} micro-batches x "
        f"{best.data_parallel} replicas, schedule {best.schedule}, "
        "predicted step "
        f"{_seconds(best.step_time)}\n"
        f"cluster: {cluster.gpus} devices, {cluster.gpus_per_node} per node, "
        f"{format_bytes(float(cluster.gpu_memory))} each; costs from {costs}\n"
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
    for s in range(plan.num_stages):  # every one (a long pipeline's middle was left out once)
        send = format_bytes(float(plan.send_bytes[s])) if s < plan.num_stages - 1 else "-"
        memory = format_bytes(best.memory[s]) if best.memory else "-"
        table.add_row(str(s), _seconds(float(plan.forward[s])),
                      _seconds(float(plan.recompute[s])), _seconds(float(plan.backward[s])),
                      send, format_bytes(float(plan.weights[s])), memory)
    return table


# -- JSON ----------------------------------------------------------------------------------------


def alternative_as_dict(row: Alternative) -> dict[str, Any]:
    return {**dataclasses.asdict(row), "stage_memory": list(row.stage_memory),
            "samples_per_second": row.throughput}


def plan_as_dict(plan: Plan) -> dict[str, Any]:
    """A compiled plan as JSON-ready data (seconds and bytes as plain numbers)."""
    return {
        "model": plan.model_name, "tracer": plan.tracer, "stages": plan.stages,
        "data_parallel": plan.data_parallel, "micro_batch_size": plan.micro_batch_size,
        "num_micro_batches": plan.num_micro_batches,
        "global_batch_size": plan.global_batch_size, "schedule": plan.schedule.name,
        "recompute": list(plan.recompute), "predicted_step_time": plan.predicted_step_time,
        "balance": plan.balance, "tied_parameters": plan.tied_parameters,
        "stage_costs": [dataclasses.asdict(s) for s in plan.stage_costs],
        "alternatives": [alternative_as_dict(a) for a in plan.alternatives],
    }


def search_as_dict(cluster: Cluster, name: str, result: SearchResult, measured: bool,
                   note: str | None, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """What ``varuna-fx plan`` prints, as JSON-ready data."""
    best = result.best
    plan = best.plan
    assert plan is not None
    last = plan.num_stages - 1
    return {
        "model": name,
        "cluster": {"gpus": cluster.gpus, "gpus_per_node": cluster.gpus_per_node,
                    "gpu_memory": float(cluster.gpu_memory), "device": cluster.kind},
        "costs": "measured" if measured else "flop estimates",
        "choice": {"stages": best.stages, "data_parallel": best.data_parallel,
                   "micro_batch_size": best.micro_batch_size,
                   "num_micro_batches": best.num_micro_batches, "schedule": best.schedule,
                   "global_batch_size": best.samples,
                   "devices_used": best.stages // result.stages_per_rank * best.data_parallel,
                   "predicted_step_time": best.step_time,
                   "samples_per_second": best.samples / best.step_time},
        "note": note,
        "explain": explain_pick(result.alternatives),
        "options": options or {},
        "alternatives": [alternative_as_dict(a) for a in result.alternatives],
        "stages": [{"stage": s, "forward": float(plan.forward[s]),
                    "recompute": float(plan.recompute[s]), "backward": float(plan.backward[s]),
                    "send_bytes": float(plan.send_bytes[s]) if s < last else 0.0,
                    "weights_and_optimizer_bytes": float(plan.weights[s]),
                    "memory": best.memory[s] if best.memory else None}
                   for s in range(plan.num_stages)],
        "search": {"considered": result.considered, "partitioned": result.partitioned,
                   "simulated": result.simulated, "seconds": result.seconds},
    }
