"""Virtual stages measured: 2 gloo ranks x 2 stages each against our 1F1B at P = 2.

Run (root, iproute2): ``python bench/bench_virtual.py --write`` (``--links unshaped,100mbit``
by default; ``--models gpt,mlp``). Each link gets one launch of two ranks, each rank in its own
network namespace joined by a veth pair (``tests/support/netns.py``; "unshaped": no ``tc`` limit), gloo
bound to the veth, one thread per rank, rank i pinned to core i. Per model (the GPT with a
16k-vocabulary untied head, and the uniform MLP of ``bench_network.py``), m = 4 micro-batches,
no recompute, partitions from a measured profile (``profile=True``, measured in a launch of
its own first and cached), a step is forward + backward of the whole batch:

- ``1f1b P=2`` / ``varuna P=2``: one stage per rank;
- ``interleaved-1f1b P=4 v=2`` / ``zbv P=4 v=2``: four stages, two per rank;
- ``planner``: ``vf.compile(model, global_batch_size=batch, stages=None, stages_per_rank=None,
  schedule="auto", profile=True)``: the planner's pick, virtual schedules among its choices.

Variants run in rotating rounds (``bench_network.measure``); a row's time is the median of its
timed steps and its spread the range of its round medians. Ratios are against ``1f1b P=2`` of
the same launch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from bench_network import M, make_cases, measure, ours, summary  # noqa: E402
from common import join_as_rank, run_pair_in_namespaces, write_block  # noqa: E402

COMMAND = "python bench/bench_virtual.py --write"
PORT = 29631


def variants(case: dict, planner: bool) -> dict[str, Any]:
    batch = case["x"].shape[0]
    fixed = dict(micro_batch_size=batch // M, recompute=False, profile=True)
    made = {
        "1f1b P=2": ours(case, stages=2, schedule="1f1b", **fixed),
        "varuna P=2": ours(case, stages=2, schedule="varuna", **fixed),
        "interleaved-1f1b P=4 v=2": ours(case, stages=4, stages_per_rank=2,
                                         schedule="interleaved-1f1b", **fixed),
        "zbv P=4 v=2": ours(case, stages=4, stages_per_rank=2, schedule="zbv", **fixed),
    }
    if planner:
        made["planner"] = ours(case, global_batch_size=batch, stages_per_rank=None,
                               schedule="auto", profile=True)
    return made


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    rank = join_as_rank(pin=True)
    rows = []
    for case in make_cases(args.models.split(",")):
        made = variants(case, args.planner)
        if args.profile_only:
            continue
        load = os.getloadavg()[0]
        times = measure(made, args.rounds, args.warmup, args.steps, set())
        for name, (_, predicted, note) in made.items():
            median, spread = summary(times[name])
            rows.append(dict(link=args.link, model=case["name"], title=case["title"],
                             variant=name, ms=1e3 * median, spread=spread, note=note,
                             load=[load, os.getloadavg()[0]],
                             predicted_ms=None if predicted is None else 1e3 * predicted))
        del made
    if rank == 0 and args.out:
        Path(args.out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def launch(args: argparse.Namespace, link: str, cache: str, out: Path | None,
           profile_only: bool = False) -> None:
    extra = ["--worker", "--link", link, "--models", args.models, "--steps", str(args.steps),
             "--warmup", str(args.warmup), "--rounds", str(args.rounds),
             *(["--planner"] if args.planner else []),
             *(["--profile-only"] if profile_only else []), *(["--out", str(out)] if out else [])]
    run_pair_in_namespaces(__file__, extra, link=None if link == "unshaped" else link,
                           port=PORT, cache=cache, timeout=args.timeout)


def simulated() -> list[str]:
    """The bubble with unit costs (F = 1, B = 2 for a whole rank's share of the model, so a
    stage of v per rank costs 1/v of it), free links: the issue's target at P = 4, m = 8."""
    from varuna_fx.schedule import build_schedule, simulate

    lines = ["Simulated (unit costs split evenly over a rank's stages, free links; ideal "
             "step = 3 m):", "", "| ranks | m | schedule | v | step | bubble | bubble time "
             "vs 1f1b |", "| ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for ranks, m in ((4, 8), (2, 4)):
        base = simulate(build_schedule("1f1b", ranks, m, False), [1.0] * ranks, [2.0] * ranks)
        for name, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4),
                        ("zbv", 2)):
            p = ranks * v
            sim = simulate(build_schedule(name, p, m, False, stages_per_rank=v if v > 1
                                          else None), [1.0 / v] * p, [2.0 / v] * p)
            lines.append(f"| {ranks} | {m} | {name} | {v} | {sim.step_time:g} | "
                         f"{sim.bubble_fraction:.3f} | "
                         f"{(sim.step_time - 3 * m) / (base.step_time - 3 * m):.2f} |")
    return lines + [""]


def report(rows: list[dict], settings: str) -> str:
    lines = [f"Command: `{COMMAND}` ({settings}). The machine was shared with other engineers' "
             "jobs (2 cores, load average in the last column): compare ratios within one "
             "link's launch, and read them against the spread.", "", *simulated()]
    for link in dict.fromkeys(r["link"] for r in rows):
        for model in dict.fromkeys(r["model"] for r in rows if r["link"] == link):
            sel = [r for r in rows if r["link"] == link and r["model"] == model]
            base = next(r["ms"] for r in sel if r["variant"] == "1f1b P=2")
            lines += [f"**{sel[0]['title']}, {link}**", "",
                      "| variant | step (ms) | spread | vs 1f1b P=2 | predicted (ms) | plan | "
                      "load |", "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
            for r in sel:
                pred = "-" if r["predicted_ms"] is None else f"{r['predicted_ms']:.1f}"
                lines.append(f"| {r['variant']} | {r['ms']:.1f} | {100 * r['spread']:.0f}% | "
                             f"{r['ms'] / base:.3f} | {pred} | {r['note']} | "
                             f"{r['load'][0]:.1f}-{r['load'][1]:.1f} |")
            lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", default="unshaped,100mbit")
    parser.add_argument("--models", default="gpt,mlp")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--planner", action="store_true", help="add the planner's pick")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--link", default="unshaped", help=argparse.SUPPRESS)
    parser.add_argument("--profile-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "cache")
        for link in args.links.split(","):
            launch(args, link, cache, None, profile_only=True)
            out = Path(tmp) / f"{link}.json"
            launch(args, link, cache, out)
            rows += json.loads(out.read_text())
    settings = (f"m={M}, {args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up, "
                f"links {args.links}")
    block = report(rows, settings)
    print(block)
    if args.write:
        write_block("bench_virtual.py", block)


if __name__ == "__main__":
    main()
