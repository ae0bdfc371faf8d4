"""Are compile's defaults our fastest? And how far is each from the 1F1B bubble bound?

Run (root, iproute2): ``python bench/bench_defaults.py --write`` (``--links unshaped,100mbit``,
``--models gpt,mlp``, ``--rounds``). The two-rank setting of ``bench_network.py`` (its models,
P=2, m=4, gloo over a veth pair in two network namespaces, rank i pinned to core i, the link
shaped with tbf or not), its variants run side by side in interleaved rounds:

- ``defaults``: ``vf.compile(model, stages=2, micro_batch_size=batch/m)``, nothing else
  (the default schedule was "varuna" when the runs in RESULTS.md were made; it is "auto" now);
- ``auto``: the same with ``schedule="auto"`` (the planner picks the schedule);
- ``varuna`` / ``1f1b`` / ``gpipe`` / ``varuna-zb`` / ``1f1b-zb``: each schedule explicitly,
  no recompute, partitioned from a measured profile (as in ``bench_network.py``), or with
  ``--estimates`` from the same FLOP estimates as the defaults (no profile launch: only the
  schedule differs from ``defaults``);
- ``pipelining 1F1B``: torch.distributed.pipelining split at the middle block;
- ``eager m``: eager PyTorch on the whole batch split into the same m micro-batches
  (gradient accumulation), one process per core, both at once (as the pipeline's ranks run).

Issue 23's bound: ``eager m x (m + P - 1) / (m P)``, what a 1F1B pipeline of two perfectly
balanced stages with free links and no overhead would take.

On a machine shared with other jobs, wall times move by tens of percent between rounds, so
every variant of ours is also traced (``StageExecutor.trace``: each action's CPU time, waits
excluded) and its step *replayed* with the median CPU time of each (stage, action kind) on the
order it ran plus the measured time outside actions (``bench_step_breakdown.replay``): what
the step would take with a core per rank. The eager bound gets the same treatment (its CPU
time per step). The replayed columns compare schedules and the bound with the load taken out
(cache contention from other jobs still inflates CPU times a little). Reported per link and model: every
variant's median step, its spread (range of the per-round medians / median), the ratios the
targets name (defaults vs our best explicit schedule, vs pipelining's 1F1B, vs the bound), and
the verdicts. The machine may be shared: only ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from bench_network import (  # noqa: E402
    M,
    Variant,
    known_schedules,
    launch,
    make_cases,
    measure,
    ours,
    pipelining,
    summary,
)
from bench_step_breakdown import action_times, replay  # noqa: E402
from common import join_as_rank, write_block  # noqa: E402

COMMAND = "python bench/bench_defaults.py --write"
EXPLICIT = "varuna,1f1b,gpipe,varuna-zb,1f1b-zb"


def eager(case: dict, cpu: list[float]) -> Variant:
    """Gradient accumulation over M micro-batches in this process: the bound's kernels.
    Each step's CPU time goes to ``cpu``."""
    import copy

    model = copy.deepcopy(case["model"])
    x, y, loss_fn = case["x"], case["y"], case["loss"]
    xs, ys = x.chunk(M), y.chunk(M)

    def step() -> Any:
        start = time.process_time()
        for p in model.parameters():
            p.grad = None
        total = 0.0
        for xb, yb in zip(xs, ys):
            loss = loss_fn(model(xb), yb) / M
            loss.backward()
            total += float(loss.detach())
        cpu.append(time.process_time() - start)
        return total

    return step, None, f"eager, {M} micro-batches of {x.shape[0] // M}"


def traced(case: dict, traces: dict[str, list], name: str, **options: Any) -> Variant:
    """``bench_network.ours`` with every step's executor trace (and its wall time) kept in
    ``traces[name]``, and the plan's schedule (the order the replay simulates)."""
    step, predicted, note = ours(case, **options)
    pipe = step.pipe  # type: ignore[attr-defined]
    executor = pipe.runtime.executor
    traces[name] = []

    def timed() -> Any:
        executor.trace = []
        start = time.perf_counter()
        out = step()
        traces[name].append((executor.trace, time.perf_counter() - start))
        executor.trace = None
        return out

    timed.schedule = pipe.plan.schedule  # type: ignore[attr-defined]
    return timed, predicted, note


def replayed_cpu(schedule: Any, per_rank: list[list[tuple[list, float]]]
                 ) -> tuple[float, dict[str, float], float]:
    """The step replayed with the median CPU time of each (stage, kind) and the time outside
    actions (the busier rank's), as ``bench_step_breakdown.analyse`` does; with those CPU
    times (seconds per micro-batch, keyed "stage kind") and the outside time."""
    measured: dict[tuple[int, str], tuple[float, float]] = {}
    outside: list[list[float]] = []
    for stage, steps in enumerate(per_rank):
        kinds: dict[str, list[tuple[float, float]]] = {}
        outside.append([])
        for trace, total in steps:
            outside[-1].append(total - sum(t[3] for t in trace if t[0] != "wait"))
            for kind, values in action_times(trace).items():
                kinds.setdefault(kind, []).extend(values)
        for kind, values in kinds.items():
            measured[stage, kind] = (statistics.median(w for w, _ in values),
                                     statistics.median(c for _, c in values))
    over = min(statistics.median(o) for o in outside)
    links = [schedule.costs.link(i) for i in range(schedule.num_stages - 1)] \
        if schedule.costs is not None else [0.0] * (schedule.num_stages - 1)
    step = replay(schedule, measured, (0, "W") in measured, links, over, 1)
    return step, {f"{stage} {kind}": cpu for (stage, kind), (_, cpu) in measured.items()}, over


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    rank = join_as_rank(args.pin)
    schedules = known_schedules(args.schedules.split(","))
    rows = []
    for case in make_cases(args.models.split(",")):
        batch = case["x"].shape[0]
        fixed = dict(stages=2, micro_batch_size=batch // M)
        profiled = not args.estimates
        if args.profile_only:
            for s in schedules:
                ours(case, **fixed, schedule=s, recompute=False, profile=True)
            continue
        traces: dict[str, list] = {}
        variants: dict[str, Variant] = {
            "defaults": traced(case, traces, "defaults", **fixed),
            "auto": traced(case, traces, "auto", **fixed, schedule="auto")}
        for s in schedules:
            variants[s] = traced(case, traces, s, **fixed, schedule=s, recompute=False,
                                 profile=profiled)
        variants["pipelining 1F1B"] = pipelining(case, "1f1b")
        eager_cpu: list[float] = []
        variants["eager m"] = eager(case, eager_cpu)
        load = os.getloadavg()[0]
        times = measure(variants, args.rounds, args.warmup, args.steps, set())
        # the timed steps' traces (the first round's warm-up steps come first), both ranks
        mine = {name: [(t, w) for t, w in got[args.warmup:]] for name, got in traces.items()}
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, [mine, eager_cpu[args.warmup:]])
        for name, (step, predicted, note) in variants.items():
            median, spread = summary(times[name])
            cpu, actions, outside = None, None, None
            if name in traces:
                cpu, actions, outside = replayed_cpu(
                    step.schedule, [gathered[0][0][name], gathered[1][0][name]])
            elif name == "eager m":
                cpu = statistics.median(gathered[0][1])
            rows.append(dict(link=args.link, model=case["name"], title=case["title"],
                             variant=name, ms=1e3 * median, spread=spread,
                             rounds=[1e3 * statistics.median(got) for got in times[name]],
                             note=note, load=[load, os.getloadavg()[0]],
                             cpu_ms=None if cpu is None else 1e3 * cpu,
                             actions_ms=None if actions is None else
                             {k: 1e3 * v for k, v in sorted(actions.items())},
                             outside_ms=None if outside is None else 1e3 * outside,
                             predicted_ms=None if predicted is None else 1e3 * predicted))
        del variants
    if rank == 0 and args.out:
        Path(args.out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _verdict(value: float, limit: float, spread: float) -> str:
    near = abs(value - limit) <= spread * limit
    return ("met" if value <= limit else "MISSED") + \
        (f" (within noise: spread {spread:.1%})" if near else "")


def report(rows: list[dict]) -> str:
    lines: list[str] = []
    verdicts = ["Targets (issue 23), this run:", ""]
    for link in dict.fromkeys(r["link"] for r in rows):
        for model in dict.fromkeys(r["model"] for r in rows):
            sel = {r["variant"]: r for r in rows if (r["link"], r["model"]) == (link, model)}
            if not sel:
                continue
            first = next(iter(sel.values()))
            ref = sel["pipelining 1F1B"]["ms"]
            bound = sel["eager m"]["ms"] * (M + 1) / (2 * M)  # P = 2
            explicit = [v for v in EXPLICIT.split(",") if v in sel]
            best = min(explicit, key=lambda v: sel[v]["ms"])
            cpu_bound = sel["eager m"]["cpu_ms"] * (M + 1) / (2 * M)
            cpu_best = min(explicit, key=lambda v: sel[v]["cpu_ms"])
            lines.append(f"\n### {first['title']}, link {link}\n")
            lines.append(f"Load average (1 min) {first['load'][0]:.1f} at the start, "
                         f"{first['load'][1]:.1f} at the end. Bound: eager m "
                         f"{sel['eager m']['ms']:.1f} ms x (m+P-1)/(mP) = {bound:.1f} ms "
                         f"(CPU: {sel['eager m']['cpu_ms']:.1f} ms -> {cpu_bound:.1f} ms).\n")
            lines.append("| variant | step (ms) | spread | per-round medians (ms) | / best "
                         "explicit | / pipelining 1F1B | / bound | replay cpu (ms) | / best "
                         "explicit (cpu) | / bound (cpu) | predicted (ms) | configuration |")
            lines.append("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: "
                         "| ---: | --- |")
            for name, r in sel.items():
                pred = f"{r['predicted_ms']:.1f}" if r["predicted_ms"] else ""
                rounds = ", ".join(f"{t:.0f}" for t in r["rounds"])
                cpu = r.get("cpu_ms")
                cpu_cols = (f"{cpu:.1f} | {cpu / sel[cpu_best]['cpu_ms']:.3f} | "
                            f"{cpu / cpu_bound:.3f}") if cpu else " | | "
                lines.append(f"| {name} | {r['ms']:.1f} | {r['spread']:.1%} | {rounds} | "
                             f"{r['ms'] / sel[best]['ms']:.3f} | {r['ms'] / ref:.3f} | "
                             f"{r['ms'] / bound:.3f} | {cpu_cols} | {pred} | {r['note']} |")
            breakdown = [f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in r["actions_ms"]
                                                 .items()) + f"; outside {r['outside_ms']:.1f}"
                         for name, r in sel.items() if r.get("actions_ms")]
            if breakdown:
                lines.append("\nCPU ms per micro-batch by stage and action (median), and per "
                             "step outside actions:\n")
                lines += [f"- {line}" for line in breakdown]
            where = f"{model} @ {link}"
            for name in ("defaults", "auto"):
                t = sel[name]["ms"]
                spread = max(sel[name]["spread"], sel[best]["spread"])
                verdicts.append(f"- {where}: {name} {t / sel[best]['ms']:.3f}x our best "
                                f"explicit ({best}) (<= 1.03) "
                                + _verdict(t / sel[best]["ms"], 1.03, spread))
            limit = 0.85 if model == "gpt" else 1.0
            t = sel["defaults"]["ms"]
            spread = max(sel["defaults"]["spread"], sel["pipelining 1F1B"]["spread"])
            verdicts.append(f"- {where}: defaults {t / ref:.3f}x pipelining 1F1B (<= {limit}) "
                            + _verdict(t / ref, limit, spread))
            spread = max(sel["defaults"]["spread"], sel["eager m"]["spread"])
            verdicts.append(f"- {where}: defaults {t / bound:.3f}x the bound (<= 1.05) "
                            + _verdict(t / bound, 1.05, spread))
            for name in ("defaults", "auto"):
                c = sel[name]["cpu_ms"]
                verdicts.append(f"- {where} (replayed CPU): {name} "
                                f"{c / sel[cpu_best]['cpu_ms']:.3f}x our best explicit "
                                f"({cpu_best}), {c / cpu_bound:.3f}x the bound")
            if "varuna" in sel and "1f1b" in sel:
                v = sel["varuna"]["ms"] / sel["1f1b"]["ms"]
                spread = max(sel["varuna"]["spread"], sel["1f1b"]["spread"])
                verdicts.append(f"- {where}: varuna {v:.3f}x our 1f1b (<= 1) "
                                + _verdict(v, 1.0, spread))
    return "\n".join([*lines, "", *verdicts])


def write(text: str) -> None:
    import torch

    write_block("bench_defaults.py",
                f"Command: `{COMMAND}` (torch {torch.__version__}, {os.cpu_count()} CPU cores, "
                f"shared by several engineers' jobs while it ran). Step: median of every timed "
                f"step; spread: range of the per-round medians / median.\n{text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", default="unshaped,100mbit")
    parser.add_argument("--models", default="gpt,mlp")
    parser.add_argument("--schedules", default=EXPLICIT)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--estimates", action="store_true",
                        help="explicit schedules from FLOP estimates (no profile launch)")
    parser.add_argument("--write", action="store_true", help="put the tables into RESULTS.md")
    parser.add_argument("--report", action="store_true", help="tables from the saved run")
    parser.add_argument("--prefix", default="netd")
    parser.add_argument("--timeout", type=float, default=1500.0, help="seconds per launch")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--link", default="unshaped", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.zb = False  # (launch passes it on)
    saved = HERE / "figures" / "defaults.json"
    if args.report:
        text = report(json.loads(saved.read_text()))
    elif args.worker:
        worker(args)
        return
    else:
        if os.geteuid() != 0:
            raise SystemExit("bench_defaults.py creates network namespaces: run it as root")
        rows: list[dict] = []
        with tempfile.TemporaryDirectory(prefix=args.prefix) as tmp:
            started = time.time()
            cache = str(Path(tmp) / "profile")
            if not args.estimates:
                launch(args, None, cache, None, profile_only=True, script=__file__)
                print(f"profiled in {time.time() - started:.0f} s", flush=True)
            for link in args.links.split(","):
                out = Path(tmp) / f"{link}.json"
                launch(args, None if link == "unshaped" else link, cache, out, script=__file__)
                rows += json.loads(out.read_text())
                saved.write_text(json.dumps(rows, indent=1))
                print(f"{link} done at {time.time() - started:.0f} s", flush=True)
        text = report(rows)
    print(text)
    if args.write:
        write(text)


if __name__ == "__main__":
    main()
