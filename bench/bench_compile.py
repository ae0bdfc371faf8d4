"""Compile time of ``vf.compile`` for a 48-layer, d=1024 GPT (~350M parameters), per phase.

Run: ``python bench/bench_compile.py`` (``--profile fx`` adds a cProfile of one cold compile).
Each configuration runs in a fresh interpreter, so "cold" is the first compile of a process (what
a user pays) and "warm" the median of 3 more compiles of new models in the same process. Phases
are timed by wrapping the functions that ``varuna_fx.api`` and its pass list
(``codegen/pass_list.py``) call (no change to the package).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import pstats
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import varuna_fx as vf
import varuna_fx.api as api
import varuna_fx.codegen.pass_list as pass_list
import varuna_fx.passes.frontend as frontend
import varuna_fx.pipeline as pipeline
import varuna_fx.planner.configure as configure
from varuna_fx.examples import GPT, GPTConfig

CFG = GPTConfig(n_layer=48, n_embd=1024, n_head=16, vocab_size=50257, block_size=1024)
STAGES = 8
WARM = 3  # warm compiles per configuration; the median is reported
PHASES: dict[str, list[str]] = {  # reported phase -> functions api.compile calls
    "capture": ["bind_inputs", "capture", "canonical_names"],
    "annotate": ["annotate_shapes", "annotate_backward", "mark_replicable"],
    "partition": ["choose_configuration", "assign_stages", "check_assignment"],
    "split+codegen": ["split_stages", "check_split", "build_stage", "check_parameters"],
    "plan+runtime": ["stage_totals", "price", "make_pipeline"],
}
TIMES: dict[str, float] = defaultdict(float)


def _timed(module: Any, name: str) -> None:
    fn: Callable[..., Any] = getattr(module, name)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - start

    setattr(module, name, wrapper)


HOTSPOTS = ["capture", "_run_fake", "_fit_shape", "split_stages", "build_stage"]


def instrument() -> None:
    import varuna_fx.passes.annotate_shapes as shapes

    _timed(shapes, "_run_fake")
    _timed(shapes, "_fit_shape")

    for names in PHASES.values():
        for name in names:  # patch the module whose pass list calls it
            for module in (api, pass_list, frontend, configure, pipeline):
                if hasattr(module, name):
                    _timed(module, name)
                    break


def build(device: str) -> tuple[torch.nn.Module, float]:
    start = time.perf_counter()
    with torch.device(device):
        model = GPT(CFG)
    return model, time.perf_counter() - start


def compile_once(model: torch.nn.Module, tracer: str) -> dict[str, float]:
    TIMES.clear()
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.block_size))
    cluster = vf.Cluster(gpus=STAGES, gpus_per_node=8, gpu_memory="80GiB")
    start = time.perf_counter()
    pipe = vf.compile(model, cluster, (tokens,), stages=STAGES, tracer=tracer)
    total = time.perf_counter() - start
    assert len(pipe.stages) == STAGES
    row = {phase: sum(TIMES[n] for n in names) for phase, names in PHASES.items()}
    row.update({f"fn:{n}": TIMES[n] for n in HOTSPOTS})
    row["total"] = total
    row["balance"] = pipe.plan.balance
    return row


def child(tracer: str, device: str) -> None:
    """Runs in a fresh interpreter: prints JSON with a cold and a warm compile."""
    instrument()
    model, built = build(device)
    cold = compile_once(model, tracer)
    warms = sorted((compile_once(build(device)[0], tracer) for _ in range(WARM)),
                   key=lambda r: r["total"])
    warm = warms[len(warms) // 2]  # the median run, by total
    print(json.dumps({"build": built, "cold": cold, "warm": warm}))


def profile(tracer: str) -> None:
    model, _ = build("meta")
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.block_size))
    cluster = vf.Cluster(gpus=STAGES, gpus_per_node=8, gpu_memory="80GiB")
    prof = cProfile.Profile()
    prof.runcall(vf.compile, model, cluster, (tokens,), stages=STAGES, tracer=tracer)
    stats = pstats.Stats(prof).strip_dirs()
    stats.sort_stats("cumulative").print_stats(30)
    stats.sort_stats("tottime").print_stats(20)


def main() -> None:
    runs = [("fx", "meta"), ("export", "meta"), ("fx", "cpu")]
    table = Table(title=f"vf.compile, GPT 48 x 1024 (~354M params), batch (2, 1024), P={STAGES}")
    for col in ["tracer", "params", "run", "total s", *PHASES, "balance"]:
        table.add_column(col, justify="right")
    builds, hot = [], {}
    for tracer, device in runs:
        out = subprocess.run([sys.executable, __file__, "--child", tracer, device],
                             capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        builds.append(f"{device} {result['build']:.2f} s")
        for run in ("cold", "warm"):
            r = result[run]
            table.add_row(tracer, device, run, f"{r['total']:.2f}",
                          *(f"{r[p]:.2f}" for p in PHASES), f"{r['balance']:.3f}")
        table.add_section()
        hot[f"{tracer}/{device}"] = result["warm"]
    table.caption = f"model construction (not in total): {', '.join(builds)}"
    detail = Table(title="Hotspots in the warm compiles (s; _run_fake: 2 calls, build_stage: P)")
    detail.add_column("function")
    for key in hot:
        detail.add_column(key, justify="right")
    for name in HOTSPOTS:
        detail.add_row(name, *(f"{r[f'fn:{name}']:.2f}" for r in hot.values()))
    console = Console(width=140)
    console.print(table)
    console.print(detail)


if __name__ == "__main__":
    from results import recorded

    with recorded("bench_compile.py", part="profile" if "--profile" in sys.argv else None):
        parser = argparse.ArgumentParser()
        parser.add_argument("--child", nargs=2, metavar=("TRACER", "DEVICE"))
        parser.add_argument("--profile", metavar="TRACER")
        args = parser.parse_args()
        if args.child:
            child(*args.child)
        elif args.profile:
            profile(args.profile)
        else:
            main()
