"""Pipelines against torch's own pipelining, DDP and FSDP2 on commodity links, for real.

Run (root, iproute2): ``python bench/bench_network.py --write`` -- about 15 minutes on a
quiet 2-core machine (``--quick``: a smoke run; ``--links``/``--models`` narrow it;
``--write`` replaces the previous run's block in bench/RESULTS.md). Two ranks (gloo on CPU,
one thread each), each inside its own network namespace, joined by a veth pair that
``tc ... tbf`` limits to 1 Gbit/s and 100 Mbit/s each way (and once unshaped). Rendezvous is env:// (a TCP store on rank 0's namespace address), gloo
bound to the veth (GLOO_SOCKET_IFNAME), so every byte between the ranks crosses the shaped link.

Per link and model (the GPT with a 16k-vocabulary head, a uniform MLP), side by side, in
interleaved rounds (see ``measure``): a row's step time is the median of all its timed steps
and its spread the range of its per-round medians, so a reader can tell a real gap from noise:

- ``defaults``: ``vf.compile(model, stages=2, micro_batch_size=batch/m)``, nothing else: the
  library's default schedule and recompute, FLOP estimates, links measured by Cluster.local();
- ``varuna`` / ``1f1b`` / ``gpipe`` / ``varuna-zb`` / ``1f1b-zb`` (``--schedules``; the split
  backward ones where this version has them): our schedules without recompute, partitioned
  from a measured profile;
- ``planner``: ``vf.compile(model, global_batch_size=batch, profile=True, schedule="auto")``:
  the planner's own pick of everything -- P, D, the micro-batch size, recompute and the
  schedule (any of ours, split backward included) -- for the 2 ranks and the measured link;
- ``pipelining 1F1B`` / ``pipelining GPipe``: torch.distributed.pipelining split at the middle
  block; ``pipelining ZB`` (ScheduleInterleavedZeroBubble, 2 stages per rank) with ``--zb``;
- ``DDP`` and ``FSDP2`` (``fully_shard``): the whole model on each rank, half the batch each.

A step is forward + backward of the whole batch (no optimizer) everywhere. Rank i is pinned to
core i (``--no-pin``: not), for every variant alike, as if on two machines. The profile for the
``profile=True`` variants is measured in a launch of its own (never in the timed runs) right
before each link's measured launch (``--profile-once``: once, before the first link) and
cached; the measured launch loads it and measures only the link. The simulator's error is
``predicted / measured - 1`` of every variant that has a prediction. Results: a table per link
(ratios vs pipelining 1F1B), JSON in ``bench/figures/network.json`` and a chart
``bench/figures/network.png``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from common import join_as_rank, mlp_stack, mse, run_pair_in_namespaces, write_block  # noqa: E402

COMMAND = "python bench/bench_network.py --write"
M = 4  # micro-batches per step
PORT = 29611


# -- models -------------------------------------------------------------------------------------

def make_cases(names: list[str]) -> list[dict]:
    """(name, model, input, target, loss, pipelining split) with the same seed on every rank."""
    import torch
    from torch import nn

    from varuna_fx.examples import GPT, GPTConfig, lm_loss

    cases = []
    torch.manual_seed(0)
    if "gpt" in names:
        cfg = GPTConfig(vocab_size=16000, block_size=32, n_layer=8, n_head=8, n_embd=512)
        gpt = GPT(cfg)
        gpt.lm_head.weight = nn.Parameter(gpt.wte.weight.detach().clone())  # untied head
        tokens = torch.randint(0, cfg.vocab_size, (16, cfg.block_size + 1))
        cases.append(dict(name="gpt", title="GPT, 16k head", model=gpt, x=tokens[:, :-1],
                          y=tokens[:, 1:], loss=lm_loss, split="h.4",
                          zb_splits=["h.2", "h.4", "h.6"]))
    if "mlp" in names:
        mlp = mlp_stack()
        x = torch.randn(128, 1024)
        cases.append(dict(name="mlp", title="uniform MLP 8x1024", model=mlp, x=x,
                          y=torch.randn_like(x), loss=mse, split="layers.4",
                          zb_splits=["layers.2", "layers.4", "layers.6"]))
    return cases


# -- variants: each returns (step function, predicted seconds or None, description) --------------

Variant = tuple[Callable[[], Any], float | None, str]


def ours(case: dict, **options: Any) -> Variant:
    import varuna_fx as vf

    model = copy.deepcopy(case["model"])
    x, y = case["x"], case["y"]
    pipe = vf.compile(model, example_inputs=(x,), loss_fn=case["loss"], **options)
    plan = pipe.plan
    share = x.shape[0] // plan.data_parallel
    start = pipe.replica_index * share
    xs, ys = x[start:start + share], y[start:start + share]

    def step() -> Any:
        pipe.zero_grad()
        return pipe.step(xs, target=ys)

    step.pipe = pipe  # type: ignore[attr-defined]  # (bench_defaults.py traces it)
    cut = plan.stage_costs[0].boundary_bytes if plan.stages > 1 else 0
    schedule = getattr(plan.schedule, "name", plan.schedule)  # a Schedule, or its name
    recompute = plan.recompute if isinstance(plan.recompute, bool) else \
        "".join("R" if r else "-" for r in plan.recompute)  # per stage
    # the action order, short: two rows with the same configuration may still order their
    # actions differently (Varuna's order comes from the measured costs and link)
    order = ";".join("".join(f"{a.kind.name}{a.mb}" for a in acts)
                     for acts in plan.schedule.per_stage)
    note = (f"P={plan.stages} D={plan.data_parallel} b={plan.micro_batch_size} "
            f"m={plan.num_micro_batches} {schedule} recompute={recompute} "
            f"cut {cut / 2**10:.0f} KiB, order #{zlib.crc32(order.encode()) & 0xffff:04x}")
    return step, plan.predicted_step_time, note


def pipelining(case: dict, kind: str) -> Variant:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleavedZeroBubble,
        SplitPoint,
        pipeline,
    )

    model = copy.deepcopy(case["model"])
    x, y = case["x"], case["y"]
    mb = x.shape[0] // M
    rank = dist.get_rank()
    splits = case["zb_splits"] if kind == "zb" else [case["split"]]
    pipe = pipeline(model, mb_args=(x[:mb],),
                    split_spec={s: SplitPoint.BEGINNING for s in splits})
    if kind == "zb":  # looped: rank r holds stages r and r + 2
        stages = [pipe.build_stage(i, torch.device("cpu")) for i in (rank, rank + 2)]
        sched: Any = ScheduleInterleavedZeroBubble(stages, n_microbatches=M, loss_fn=case["loss"])
        params = [p for s in stages for p in s.submod.parameters()]
        last = rank == 1
    else:
        stage = pipe.build_stage(rank, torch.device("cpu"))
        cls = Schedule1F1B if kind == "1f1b" else ScheduleGPipe
        sched = cls(stage, n_microbatches=M, loss_fn=case["loss"])
        params = list(stage.submod.parameters())
        last = rank == 1

    def step() -> Any:
        for p in params:
            p.grad = None
        losses: list[torch.Tensor] = []
        if not last:  # looped (zb): rank 0 holds the first stage, rank 1 the last
            return sched.step(x, return_outputs=False)
        return sched.step(target=y, losses=losses, return_outputs=False)

    return step, None, f"split at {', '.join(splits)}"


def data_parallel(case: dict, kind: str) -> Variant:
    import torch
    import torch.distributed as dist

    model = copy.deepcopy(case["model"])
    rank, world = dist.get_rank(), dist.get_world_size()
    share = case["x"].shape[0] // world
    xs = case["x"][rank * share:(rank + 1) * share]
    ys = case["y"][rank * share:(rank + 1) * share]
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped: Any = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        # shard per transformer block (GPT) or per layer (MLP), as FSDP is meant to be used
        blocks = [m for m in model.modules() if type(m).__name__ == "Block"] or \
            [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        for block in blocks:
            fully_shard(block, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)

    def step() -> Any:
        for p in wrapped.parameters():
            p.grad = None
        loss = case["loss"](wrapped(xs), ys)
        loss.backward()
        return loss

    return step, None, f"{'DDP' if kind == 'ddp' else 'FSDP2'}, batch {share} per rank"


# -- one launch ------------------------------------------------------------------------------

def known_schedules(names: list[str]) -> list[str]:
    """The names this version of varuna_fx can build (split-backward ``*-zb`` ones only where
    that has landed), so one schedule list serves every version."""
    from varuna_fx.errors import VarunaFxError
    from varuna_fx.schedule import build_schedule

    known = []
    for name in filter(None, names):
        try:
            build_schedule(name, 2, M, False)
        except (VarunaFxError, KeyError, ValueError):
            continue
        known.append(name)
    return known


def measure(variants: dict[str, Variant], rounds: int, warmup: int, steps: int,
            slow: set[str]) -> dict[str, list[list[float]]]:
    """Step times per variant and round: ``rounds`` sweeps over the variants (the order
    rotating, so no variant always follows the same one), each variant running ``steps``
    timed steps in a row, after ``warmup`` untimed ones in the first sweep (first-step
    allocations, lazy initialisation). Background load drifts over minutes: the sweeps
    spread every variant over the whole run, and the round medians show how much one
    variant's time moves.
    ``slow`` variants (DDP/FSDP2 on a slow link: tens of seconds a step) warm up once and time
    one step in each of at most two rounds."""
    import torch.distributed as dist

    names = list(variants)
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if name in slow and r >= 2:
                continue
            step = variants[name][0]
            untimed = 0 if r else (1 if name in slow else warmup)
            timed = 1 if name in slow else steps
            got = []
            for k in range(untimed + timed):
                dist.barrier()
                start = time.perf_counter()
                step()
                dist.barrier()
                if k >= untimed:
                    got.append(time.perf_counter() - start)
            times[name].append(got)
    return times


def summary(rounds: list[list[float]]) -> tuple[float, float]:
    """(median step over all timed steps, spread): the spread is the range of the per-round
    medians relative to the median -- two identical configurations in one run should differ
    by less than their spreads."""
    flat = [t for got in rounds for t in got]
    median = statistics.median(flat)
    per_round = [statistics.median(got) for got in rounds]
    return median, (max(per_round) - min(per_round)) / median


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    rank = join_as_rank(args.pin)  # pinned: each rank on a core of its own, as on two machines
    schedules = known_schedules(args.schedules.split(","))
    rows = []
    for case in make_cases(args.models.split(",")):
        batch = case["x"].shape[0]
        if args.profile_only:  # fill the cache: the measured launches load it
            for s in schedules:
                ours(case, stages=2, micro_batch_size=batch // M, schedule=s, recompute=False,
                     profile=True)
            ours(case, global_batch_size=batch, profile=True, schedule="auto")
            continue
        variants: dict[str, Variant] = {
            "defaults": ours(case, stages=2, micro_batch_size=batch // M)}
        for s in schedules:
            variants[s] = ours(case, stages=2, micro_batch_size=batch // M, schedule=s,
                               recompute=False, profile=True)
        variants["planner"] = ours(case, global_batch_size=batch, profile=True, schedule="auto")
        variants["pipelining 1F1B"] = pipelining(case, "1f1b")
        variants["pipelining GPipe"] = pipelining(case, "gpipe")
        if args.zb:
            variants["pipelining ZB"] = pipelining(case, "zb")
        variants["DDP"] = data_parallel(case, "ddp")
        variants["FSDP2"] = data_parallel(case, "fsdp")
        slow = {"DDP", "FSDP2"} if args.link == "100mbit" else set()
        load = os.getloadavg()[0]
        times = measure(variants, args.rounds, args.warmup, args.steps, slow)
        for name, (_, predicted, note) in variants.items():
            median, spread = summary(times[name])
            rows.append(dict(link=args.link, model=case["name"], title=case["title"],
                             variant=name, ms=1e3 * median, spread=spread,
                             samples=[[1e3 * t for t in got] for got in times[name]],
                             note=note, load=[load, os.getloadavg()[0]],
                             predicted_ms=None if predicted is None else 1e3 * predicted))
        del variants
    if rank == 0 and args.out:
        from varuna_fx.world.network import measure_network

        net = measure_network()
        for row in rows:
            row["measured_link"] = None if net is None else [net.latency, net.bandwidth]
        Path(args.out).write_text(json.dumps(rows))
    elif args.out:
        from varuna_fx.world.network import measure_network

        measure_network()
    dist.barrier()
    dist.destroy_process_group()


# -- the driver --------------------------------------------------------------------------------

def launch(args: argparse.Namespace, link: str | None, cache: str, out: Path | None,
           profile_only: bool = False, script: str = __file__) -> None:
    """Both ranks of ``script``'s worker (default: this file's) in their namespaces."""
    extra = ["--worker", "--link", link or "unshaped", "--models", args.models,
             "--schedules", args.schedules, "--steps", str(args.steps), "--warmup",
             str(args.warmup), "--rounds", str(args.rounds), *(["--zb"] if args.zb else []),
             *(["--profile-only"] if profile_only else []), *(["--out", str(out)] if out else []),
             *(["--pin"] if args.pin else []),
             *(["--estimates"] if getattr(args, "estimates", False) else [])]
    run_pair_in_namespaces(script, extra, link=link, port=PORT, cache=cache,
                           timeout=args.timeout)


def report(rows: list[dict], write: bool, settings: str = "") -> str:
    lines = []
    for link in dict.fromkeys(r["link"] for r in rows):
        for model in dict.fromkeys(r["model"] for r in rows):
            sel = [r for r in rows if r["link"] == link and r["model"] == model]
            if not sel:
                continue
            ref = next(r["ms"] for r in sel if r["variant"] == "pipelining 1F1B")
            one = next((r["ms"] for r in sel if r["variant"] == "1f1b"), None)
            measured = sel[0].get("measured_link")
            bw = f", measured {measured[1] * 8 / 1e6:.0f} Mbit/s" if measured else ""
            load = sel[0].get("load")
            lines.append(f"\n### {sel[0]['title']}, link {link}{bw}\n")
            if load:
                lines.append(f"Load average (1 min) {load[0]:.1f} at the start, "
                             f"{load[1]:.1f} at the end of this table.\n")
            lines.append("| variant | step (ms) | spread | / pipelining 1F1B | / our 1f1b "
                         "| predicted (ms) | sim error | configuration |")
            lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
            for r in sel:
                pred = r["predicted_ms"]
                err = f"{pred / r['ms'] - 1:+.1%}" if pred else ""
                vs_ours = f"{r['ms'] / one:.3f}" if one else ""
                spread = f"{r['spread']:.1%}" if "spread" in r else ""
                lines.append(f"| {r['variant']} | {r['ms']:.1f} | {spread} | {r['ms'] / ref:.3f} "
                             f"| {vs_ours} | {f'{pred:.1f}' if pred else ''} | {err} | "
                             f"{r['note']} |")
    lines += ["", *targets(rows)]
    text = "\n".join(lines)
    if write:
        import torch

        write_block("bench_network.py",
                    f"Command: `{COMMAND}`{settings} (torch {torch.__version__}, "
                    f"{os.cpu_count()} CPU cores). Step: median of every timed step; spread: "
                    f"range of the per-round medians / median.\n{text}")
    return text


def noise(rows: list[dict], link: str, model: str, *variants: str) -> float:
    """The larger spread of ``variants``: a ratio between them closer than this to its limit
    is within this run's noise."""
    return max((r.get("spread", 0.0) for r in rows if (r["link"], r["model"]) == (link, model)
                and r["variant"] in variants), default=0.0)


def verdict(value: float, limit: float, spread: float, strict: bool = False) -> str:
    ok = value < limit if strict else value <= limit
    near = abs(value - limit) <= spread * limit
    return ("met" if ok else "MISSED") + (f" (within noise: spread {spread:.1%})" if near
                                          else "")


def targets(rows: list[dict]) -> list[str]:
    """Issue 10's targets, checked on this run's ratios; each says when its margin is within
    the spread of the variants it compares."""
    out = ["Targets (issue 10), this run:", ""]

    def ms(link: str, model: str, variant: str) -> float | None:
        return next((r["ms"] for r in rows if (r["link"], r["model"], r["variant"]) ==
                     (link, model, variant)), None)

    for link in dict.fromkeys(r["link"] for r in rows):
        for model in dict.fromkeys(r["model"] for r in rows):
            ref, ours_1f1b = ms(link, model, "pipelining 1F1B"), ms(link, model, "1f1b")
            if ref is None:
                continue
            where = f"{model} @ {link}"
            spreads = [r["spread"] for r in rows if (r["link"], r["model"]) == (link, model)
                       and "spread" in r]
            if spreads:
                # rows running the same configuration and action order (e.g. defaults or
                # planner and varuna): their gap is pure measurement noise
                groups: dict[str, list[dict]] = {}
                for r in rows:
                    if (r["link"], r["model"]) == (link, model) and r["predicted_ms"]:
                        groups.setdefault(r["note"], []).append(r)
                twins = "".join(
                    f"; {' and '.join(r['variant'] for r in same)}, the same configuration "
                    f"and order, differ {max(r['ms'] for r in same) / min(r['ms'] for r in same) - 1:.1%}"
                    for same in groups.values() if len(same) > 1)
                out.append(f"- noise {where}: spread of the round medians: median "
                           f"{statistics.median(spreads):.1%}, worst {max(spreads):.1%}{twins}")
            limit = 0.85 if model == "gpt" else 1.0
            defaults = ms(link, model, "defaults")
            if defaults:
                out.append(f"- {where}: defaults {defaults / ref:.3f}x pipelining 1F1B "
                           f"(<= {limit}) "
                           + verdict(defaults / ref, limit,
                                     noise(rows, link, model, "defaults", "pipelining 1F1B")))
            varuna = ms(link, model, "varuna")
            if varuna and ours_1f1b:
                spread = noise(rows, link, model, "varuna", "1f1b")
                out.append(f"- {where}: varuna {varuna / ours_1f1b:.3f}x our 1f1b "
                           f"({'< 1' if link == '100mbit' else '<= 1'}) "
                           + verdict(varuna / ours_1f1b, 1.0, spread, link == "100mbit"))
            for split in ("varuna-zb", "1f1b-zb"):
                t = ms(link, model, split)
                if t and ours_1f1b:
                    out.append(f"- {where}: {split} {t / ours_1f1b:.3f}x our 1f1b (<= 0.95, "
                               f"m = {M} <= 2P) "
                               + verdict(t / ours_1f1b, 0.95, noise(rows, link, model, split,
                                                                     "1f1b")))
            planner = ms(link, model, "planner")
            ddp, fsdp = ms(link, model, "DDP"), ms(link, model, "FSDP2")
            if planner and ddp and fsdp and link == "100mbit":
                ok = planner < min(ddp, fsdp)
                out.append(f"- {where}: planner {planner:.0f} ms vs DDP {ddp:.0f} / FSDP2 "
                           f"{fsdp:.0f} ms {'met' if ok else 'MISSED'}")
            ours_all = [r for r in rows if r["link"] == link and r["model"] == model
                        and r["predicted_ms"] is not None]
            if planner and ours_all:
                best = min(ours_all, key=lambda r: r["ms"])
                gap = planner / best["ms"] - 1
                spread = noise(rows, link, model, "planner", best["variant"])
                out.append(f"- {where}: planner's pick {gap:+.1%} vs our measured best "
                           f"({best['variant']}) (<= 5%) "
                           + verdict(1 + gap, 1.05, spread))
        errors = sorted(abs(r["predicted_ms"] / r["ms"] - 1) for r in rows
                        if r["link"] == link and r["predicted_ms"] and r["variant"] != "defaults")
        if errors:
            median, worst = statistics.median(errors), errors[-1]
            ok = median <= 0.05 and worst <= 0.10
            spreads = [r["spread"] for r in rows if r["link"] == link and "spread" in r
                       and r["predicted_ms"] and r["variant"] != "defaults"]
            typical = f" (measurement spread: median {statistics.median(spreads):.1%})" \
                if spreads else ""
            out.append(f"- simulator @ {link} (profiled variants): median |error| "
                       f"{median:.1%}, worst {worst:.1%} {'met' if ok else 'MISSED'}{typical}")
    return out


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    links = list(dict.fromkeys(r["link"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        variants = list(dict.fromkeys(r["variant"] for r in rows if r["model"] == model))
        width = 0.8 / len(links)
        for k, link in enumerate(links):
            ms = {r["variant"]: r["ms"] for r in rows if r["model"] == model and r["link"] == link}
            xs = [i + k * width for i in range(len(variants))]
            ax.bar(xs, [ms.get(v, 0.0) / 1e3 for v in variants], width, label=link)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(variants))], variants,
                      rotation=45, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("seconds per step (log)")
        ax.set_title(next(r["title"] for r in rows if r["model"] == model))
        ax.legend(title="link")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", default="unshaped,1gbit,100mbit")
    parser.add_argument("--models", default="gpt,mlp")
    parser.add_argument("--schedules", default="varuna,1f1b,gpipe,varuna-zb,1f1b-zb",
                        help="our schedules, comma-separated; unknown names are skipped")
    parser.add_argument("--rounds", type=int, default=3,
                        help="sweeps over the variants (each variant timed in every sweep)")
    parser.add_argument("--steps", type=int, default=2,
                        help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps per variant before its first timed steps")
    parser.add_argument("--quick", action="store_true",
                        help="2 rounds of 1 timed step, links unshaped and 100mbit (a smoke "
                             "run: ratios within ~the printed spread)")
    parser.add_argument("--zb", action="store_true", help="also pipelining's zero-bubble")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="pin rank i to core i (default; --no-pin lets the kernel move "
                             "them, and both ranks' threads may then share one core)")
    parser.add_argument("--profile-once", action="store_true",
                        help="profile once before the first link (default: in a launch of "
                             "its own right before each link's measured launch, so profile "
                             "and measurement see the machine in the same state)")
    parser.add_argument("--write", "--append", dest="write", action="store_true",
                        help="put this run's tables into bench/RESULTS.md (replacing the "
                             "previous run's)")
    parser.add_argument("--prefix", default="netb",
                        help="the scratch folder's name prefix")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    parser.add_argument("--cache", default="", help="keep measured profiles in this folder")
    parser.add_argument("--report", action="store_true",
                        help="only redo the tables and chart from bench/figures/network.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--link", default="unshaped", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    settings = ""
    if args.quick:
        args.rounds, args.steps = 2, 1
        if args.links == parser.get_default("links"):
            args.links = "unshaped,100mbit"
        settings = " --quick"
    settings += "".join(flag for flag, on in ((" --no-pin", not args.pin),
                                              (" --profile-once", args.profile_once)) if on)
    if args.report:  # tables and chart again from a saved run
        rows = json.loads((HERE / "figures" / "network.json").read_text())
        chart(rows, HERE / "figures" / "network.png")
        print(report(rows, args.write, settings))
        return
    if args.worker:
        worker(args)
        return
    if os.geteuid() != 0:
        raise SystemExit("bench_network.py creates network namespaces: run it as root")
    rows: list[dict] = []
    figures = HERE / "figures"
    figures.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=args.prefix) as tmp:
        started = time.time()
        for i, link in enumerate(args.links.split(",")):
            # profiles are link-independent, but the machine drifts over minutes: by default
            # each link's profile is measured (in a launch of its own, never in the timed
            # one) just before that link's runs; --cache keeps and reuses them
            cache = args.cache or str(Path(tmp) / ("profile" if args.profile_once else link))
            if i == 0 or not (args.profile_once or args.cache):
                launch(args, None, cache, None, profile_only=True)
                print(f"profiled in {time.time() - started:.0f} s", flush=True)
            out = Path(tmp) / f"{link}.json"
            launch(args, None if link == "unshaped" else link, cache, out)
            rows += json.loads(out.read_text())
            # written after every link, so an interrupted run keeps what it measured
            (figures / "network.json").write_text(json.dumps(rows, indent=1))
            print(f"{link} done at {time.time() - started:.0f} s", flush=True)
    chart(rows, figures / "network.png")
    print(report(rows, args.write, settings))


if __name__ == "__main__":
    main()
