"""Where a two-rank pipeline step goes, against what the simulator assumed.

Run: ``python bench/bench_step_breakdown.py`` (``--models gpt,mlp``, ``--schedules``; about
3 minutes on a quiet 2-core machine). Two ranks on loopback (gloo, one thread each), the
models and micro-batching of ``bench_network.py`` (P=2, m=4, no recompute, measured profile,
profiled first in a launch of its own). Every schedule is timed in interleaved rounds with the
executor's trace on (``StageExecutor.trace``), which records every action's wall and CPU time
and every wait for a message. Per stage and action kind it prints

- ``profile``: the per-micro-batch time the planner simulated with (``plan.schedule.costs``),
- ``wall`` / ``cpu``: the action's median in the run, waits for messages excluded,

so a gap splits into *the action cost more than profiled* (cpu > profile: the cost model; wall
> cpu: this process did not have its core, i.e. load) and *the step cost more than its actions*
(``outside``: step time not spent in actions or waits -- splitting the batch, the loss
all-reduce, draining sends). ``replay wall`` simulates the order each rank ran with the measured wall times
and the step's outside time: it tells whether the schedule and link model are right when the
costs are (compare with ``step``); ``replay cpu`` does the same with the CPU times: what the
step would take with a core per rank (compare with ``predicted``: the cost model's error). A shared machine inflates wall over cpu; the cpu columns stay comparable.

``--launches N`` repeats the timed two-rank launch N times with the same profile and prints one
line per launch and schedule: the step, its prediction, and every action's CPU time over the
profile's -- how far the same command moves between launches on this machine, which bounds the
simulator error it can show. Before them, one process runs each model's two stages alone
(``LocalRuntime``: no second rank sharing the chip, no messages) and its step is compared with
the profile's total work, ``m * sum(F + B)`` over the stages: the cost model's own error.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from common import SRC, join_as_rank, rank_env, wait_or_kill  # noqa: E402

PORT = 29623


def worker(args: argparse.Namespace) -> None:
    import copy

    import torch.distributed as dist
    from bench_network import M, known_schedules, make_cases

    import varuna_fx as vf

    rank = join_as_rank(pin=False)
    out = []
    for case in make_cases(args.models.split(",")):
        x, y = case["x"], case["y"]
        pipes = {}
        for s in known_schedules(args.schedules.split(",")):
            pipes[s] = vf.compile(copy.deepcopy(case["model"]), example_inputs=(x,),
                                  loss_fn=case["loss"], stages=2,
                                  micro_batch_size=x.shape[0] // M, schedule=s,
                                  recompute=False, profile=True)
        if args.profile_only:
            continue
        steps: dict[str, list[float]] = {s: [] for s in pipes}
        traces: dict[str, list[list[tuple]]] = {s: [] for s in pipes}
        names = list(pipes)
        for r in range(args.rounds):
            for s in names[r % len(names):] + names[:r % len(names)]:
                pipe = pipes[s]
                executor = pipe.runtime.executor
                for k in range(args.warmup + args.steps):
                    dist.barrier()
                    executor.trace = [] if k >= args.warmup else None
                    start = time.perf_counter()
                    pipe.zero_grad()
                    pipe.step(x, target=y)
                    dist.barrier()
                    if k >= args.warmup:
                        steps[s].append(time.perf_counter() - start)
                        traces[s].append([(w, mb, t - start, d, c)
                                          for w, mb, t, d, c in executor.trace])
                executor.trace = None
        for s, pipe in pipes.items():
            costs = pipe.plan.schedule.costs
            out.append({"model": case["name"], "schedule": s, "rank": rank,
                        "steps": steps[s], "traces": traces[s],
                        "predicted": pipe.plan.predicted_step_time,
                        "profile": None if costs is None else {
                            "F": costs.forward, "B": costs.backward,
                            "W": [costs.w(i) for i in range(costs.num_stages)],
                            "links": [costs.link(i) for i in range(costs.num_stages - 1)]}})
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, out)
    if rank == 0 and args.out:
        Path(args.out).write_text(json.dumps(gathered[0] + gathered[1]))
    dist.barrier()
    dist.destroy_process_group()


def local_worker(args: argparse.Namespace) -> None:
    """One process, both stages (no torchrun): the measured step against the profile's total
    work. Loads the profile the two-rank launch measured (same cache)."""
    import copy

    import torch

    torch.set_num_threads(1)
    from bench_network import M, make_cases

    import varuna_fx as vf

    out = []
    for case in make_cases(args.models.split(",")):
        x, y = case["x"], case["y"]
        pipe = vf.compile(copy.deepcopy(case["model"]), example_inputs=(x,),
                          loss_fn=case["loss"], stages=2, micro_batch_size=x.shape[0] // M,
                          schedule="varuna", recompute=False, profile=True)
        costs = pipe.plan.schedule.costs
        work = M * sum(f + b for f, b in zip(costs.forward, costs.backward))
        steps = []
        for k in range(args.warmup + args.rounds * args.steps):
            start = time.perf_counter()
            pipe.zero_grad()
            pipe.step(x, target=y)
            if k >= args.warmup:
                steps.append(time.perf_counter() - start)
        out.append({"model": case["name"], "steps": steps, "work": work})
    Path(args.out).write_text(json.dumps(out))


def launch_summary(launches: list[list[dict]], local: list[dict]) -> list[str]:
    """One line per launch and schedule: step vs prediction, action CPU times over profile."""
    lines = ["\n### the same command, launch after launch (ms per step; actions: median CPU "
             "time / profile, stage 0 and 1)\n"]
    for r in local:
        step = statistics.median(r["steps"])
        lines.append(f"- {r['model']}, one process (both stages, no second rank): step "
                     f"{step * 1e3:.1f} ms, profile's total work {r['work'] * 1e3:.1f} ms, "
                     f"error {100 * (r['work'] / step - 1):+.1f}%")
    lines += ["", "| model | schedule | launch | step | predicted | error | F cpu/profile | "
              "B cpu/profile |", "| --- | --- | ---: | ---: | ---: | ---: | --- | --- |"]
    errors: dict[tuple[str, str], list[float]] = {}
    for k, rows in enumerate(launches):
        for r0 in (r for r in rows if r["rank"] == 0):
            r1 = next(r for r in rows if r["rank"] == 1 and (r["model"], r["schedule"])
                      == (r0["model"], r0["schedule"]))
            step = statistics.median(max(a, b) for a, b in zip(r0["steps"], r1["steps"]))
            error = r0["predicted"] / step - 1
            errors.setdefault((r0["model"], r0["schedule"]), []).append(step)
            ratios = {}
            prof = r0["profile"]
            split = any(what == "W" for tr in r0["traces"] for what, *_ in tr)
            for kind in ("F", "B"):
                parts = []
                for stage, r in enumerate((r0, r1)):
                    cpu = [c for tr in r["traces"] for c in
                           (c for _, c in action_times(tr).get(kind, []))]
                    if prof is None or not cpu:
                        parts.append("-")
                        continue
                    ref = prof[kind][stage] - (prof["W"][stage] if split and kind == "B" else 0)
                    parts.append(f"{statistics.median(cpu) / ref:.2f}" if ref > 0 else "-")
                ratios[kind] = ", ".join(parts)
            lines.append(f"| {r0['model']} | {r0['schedule']} | {k} | {step * 1e3:.1f} | "
                         f"{r0['predicted'] * 1e3:.1f} | {100 * error:+.1f}% | "
                         f"{ratios['F']} | {ratios['B']} |")
    for (model, sched), steps in errors.items():
        if len(steps) > 1:
            lines.append(f"- {model} {sched}: step {min(steps) * 1e3:.0f}-{max(steps) * 1e3:.0f} "
                         f"ms over {len(steps)} launches ({100 * (max(steps) / min(steps) - 1):.0f}%"
                         " apart)")
    return lines


def action_times(trace: list[tuple]) -> dict[str, list[tuple[float, float]]]:
    """(wall, cpu) per action kind, each less the waits for messages inside it."""
    found: dict[str, list[tuple[float, float]]] = {}
    waits: list[tuple[float, float]] = []
    for what, _mb, _start, wall, cpu in trace:
        if what == "wait":
            waits.append((wall, cpu))
            continue
        found.setdefault(what, []).append((wall - sum(w for w, _ in waits),
                                           cpu - sum(c for _, c in waits)))
        waits = []
    return found


def replay(schedule: Any, measured: dict[tuple[int, str], tuple[float, float]], split: bool,
           links: list[float], outside: float, col: int) -> float:
    """The step simulated with the measured action times (col 0: wall, 1: cpu) and the
    measured time outside the actions."""
    from varuna_fx.schedule.simulate import simulate

    p = schedule.num_stages
    fwd = [measured[s, "F"][col] for s in range(p)]
    wgt = [measured[s, "W"][col] for s in range(p)] if split else None
    bwd = [measured[s, "B"][col] + (wgt[s] if wgt else 0.0) for s in range(p)]
    return simulate(schedule, fwd, bwd, send_bytes=links, bandwidth=1.0,
                    weight_grad=wgt).step_time + max(outside, 0.0)


def analyse(rows: list[dict]) -> list[str]:
    from varuna_fx.schedule.actions import Action, Kind, Schedule

    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        lines += [f"\n### {model}: per micro-batch (ms), median over the timed steps\n",
                  "| schedule | stage | kind | profile | cpu | wall | outside/step | "
                  "step | predicted | replay wall | replay cpu |",
                  "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for sched in dict.fromkeys(r["schedule"] for r in rows if r["model"] == model):
            per_rank = sorted((r for r in rows if (r["model"], r["schedule"]) == (model, sched)),
                              key=lambda r: r["rank"])
            step = statistics.median(max(a, b) for a, b in zip(per_rank[0]["steps"],
                                                               per_rank[1]["steps"]))
            prof = per_rank[0]["profile"]
            measured: dict[tuple[int, str], tuple[float, float]] = {}
            outside = []
            for stage, r in enumerate(per_rank):
                kinds: dict[str, list[tuple[float, float]]] = {}
                for trace, total in zip(r["traces"], r["steps"]):
                    busy = sum(w for what, _, _, w, _ in trace if what != "wait")
                    outside.append(total - busy)
                    for kind, values in action_times(trace).items():
                        kinds.setdefault(kind, []).extend(values)
                for kind, values in kinds.items():
                    measured[stage, kind] = (statistics.median(w for w, _ in values),
                                             statistics.median(c for _, c in values))
            # outside: the idle stage's waits are not "outside"; the busiest rank's is
            over = min(statistics.median(outside[:len(outside) // 2]),
                       statistics.median(outside[len(outside) // 2:]))
            p = len(per_rank)
            split = (0, "W") in measured
            # the order each rank ran (Varuna's comes from the profiled costs)
            per_stage = [[Action(s, Kind[what], mb) for what, mb, *_ in r["traces"][0]
                          if what != "wait"] for s, r in enumerate(per_rank)]
            schedule = Schedule(sched, p, sum(a.kind is Kind.F for a in per_stage[0]), False,
                                per_stage, split_backward=split)
            links = prof["links"] if prof else [0.0]

            replays = " | ".join(f"{replay(schedule, measured, split, links, over, col) * 1e3:.1f}"
                                 for col in (0, 1))
            first = True
            for (stage, kind), (wall, cpu) in sorted(measured.items()):
                ref = ""
                if prof:
                    value = {"F": prof["F"][stage], "W": prof["W"][stage],
                             "B": prof["B"][stage] - (prof["W"][stage] if split else 0.0)
                             }.get(kind)
                    ref = f"{value * 1e3:.1f}" if value is not None else ""
                tail = (f"{over * 1e3:.1f} | {step * 1e3:.1f} | "
                        f"{per_rank[0]['predicted'] * 1e3:.1f} | {replays}") if first \
                    else " | | | | "
                lines.append(f"| {sched if first else ''} | {stage} | {kind} | {ref} | "
                             f"{cpu * 1e3:.1f} | {wall * 1e3:.1f} | {tail} |")
                first = False
    return lines


def launch(args: argparse.Namespace, cache: str, out: str, profile_only: bool) -> None:
    extra = ["--worker", "--models", args.models, "--schedules", args.schedules, "--rounds",
             str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup),
             "--out", out, *(["--profile-only"] if profile_only else [])]
    procs = [subprocess.Popen([sys.executable, __file__, *extra],
                              env=rank_env(r, 2, args.port, local=False, VARUNA_FX_CACHE_DIR=cache,
                                           PYTHONPATH=str(SRC)))
             for r in (0, 1)]
    wait_or_kill(procs, args.timeout, "on loopback")


def run_local(args: argparse.Namespace, cache: str, out: str) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    subprocess.run([sys.executable, __file__, "--local-worker", "--models", args.models,
                    "--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup",
                    str(args.warmup), "--out", out],
                   env={**env, "OMP_NUM_THREADS": "1", "VARUNA_FX_CACHE_DIR": cache,
                        "PYTHONPATH": str(HERE.parent / "src")},
                   check=True, timeout=args.timeout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt")
    parser.add_argument("--schedules", default="varuna,1f1b,gpipe,varuna-zb,1f1b-zb")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--cache", default="", help="keep measured profiles in this folder")
    parser.add_argument("--port", type=int, default=PORT)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--report", default="", help="only analyse this saved JSON")
    parser.add_argument("--launches", type=int, default=1,
                        help="repeat the timed launch, same profile; with > 1 also time one "
                             "process running both stages")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--local-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.local_worker:
        local_worker(args)
        return
    if args.report:
        rows = json.loads(Path(args.report).read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="breakdown") as tmp:
            cache = args.cache or tmp
            load = os.getloadavg()[0]
            launch(args, cache, "", profile_only=True)
            local = []
            if args.launches > 1:
                out = os.path.join(tmp, "local.json")
                run_local(args, cache, out)
                local = json.loads(Path(out).read_text())
            launches = []
            for k in range(args.launches):
                out = os.path.join(tmp, f"rows{k}.json")
                launch(args, cache, out, profile_only=False)
                launches.append(json.loads(Path(out).read_text()))
            rows = launches[0]
            (HERE / "figures").mkdir(exist_ok=True)
            (HERE / "figures" / "step_breakdown.json").write_text(json.dumps(rows))
            print(f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    print("\n".join(analyse(rows)))
    if not args.report and args.launches > 1:
        print("\n".join(launch_summary(launches, local)))


if __name__ == "__main__":
    from results import recorded

    with recorded("bench_step_breakdown.py"):
        main()
