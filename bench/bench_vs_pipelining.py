"""varuna_fx's distributed runtime against torch.distributed.pipelining, side by side.

Run: ``python bench/bench_vs_pipelining.py`` (it relaunches itself on 2 local ranks with
torchrun: gloo on CPU, one thread per rank). Add ``--write`` to put the table into its block of
``bench/RESULTS.md`` (replacing the previous run's).

Both systems get the same model (same initial weights), P = 2, the same batch and number of
micro-batches, no activation recomputation (pipelining has none) and no optimizer (a step is
forward + backward of the whole batch). varuna_fx partitions with a measured profile
(``profile=True``: rank 0 times every operation once, cached on disk). pipelining traces with ``pipeline()`` and splits at the
middle block (``SplitPoint.BEGINNING``) and runs ``Schedule1F1B`` / ``ScheduleGPipe``; varuna_fx
partitions by its own cost model and runs ``schedule="1f1b"`` / ``"varuna"``. Two models: a
uniform MLP stack (the middle split is already balanced) and a GPT-style model with an untied
32k-vocabulary LM head (the head dominates, so the middle split is not). Variants run
round-robin, one step each, so background load hits all alike; reported is the median.
"""

from __future__ import annotations

import copy
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from common import mlp_stack, mse, write_block  # noqa: E402

import varuna_fx as vf  # noqa: E402
from varuna_fx.examples import GPT, GPTConfig, lm_loss  # noqa: E402

WARMUP, TIMED = 3, 10
COMMAND = "python bench/bench_vs_pipelining.py --write"
NOTES = (
    "Same model and initial weights, P=2, m=8, no recomputation on either side, a step is "
    "forward + backward of the whole batch. varuna_fx partitions from a measured profile "
    "(`profile=True`); pipelining splits at the middle block. Ratio = varuna_fx / pipelining's "
    "same-kind schedule (1f1b vs Schedule1F1B, varuna vs ScheduleGPipe). Targets: <= 1.0 on "
    "the uniform model, <= 0.85 on the GPT. The machine is shared: absolute times move between "
    "runs, so the variants run round-robin and only ratios within one run are meaningful."
)


def make_models() -> list[dict]:
    """(name, model, input, target, loss, pipelining split point); same seed on every rank."""
    torch.manual_seed(0)
    mlp = mlp_stack()
    x = torch.randn(128, 1024)
    cfg = GPTConfig(vocab_size=32000, block_size=32, n_layer=8, n_head=8, n_embd=512)
    gpt = GPT(cfg)
    gpt.lm_head.weight = nn.Parameter(gpt.wte.weight.detach().clone())  # untied
    tokens = torch.randint(0, cfg.vocab_size, (16, cfg.block_size + 1))
    return [
        dict(name="uniform MLP (8 x 1024)", model=mlp, x=x, y=torch.randn_like(x), loss=mse,
             split="layers.4"),
        dict(name="GPT, 32k LM head", model=gpt, x=tokens[:, :-1], y=tokens[:, 1:],
             loss=lm_loss, split="h.4"),
    ]


def ours(case: dict, schedule: str, m: int) -> tuple[Callable[[], float], str]:
    model = copy.deepcopy(case["model"])
    pipe = vf.compile(model, example_inputs=(case["x"],), loss_fn=case["loss"], stages=2,
                      micro_batch_size=case["x"].shape[0] // m, schedule=schedule,
                      recompute=False, profile=True)

    def step() -> float:
        pipe.zero_grad()
        return float(pipe.step(case["x"], target=case["y"]))

    return step, f"own: stage 1 from {first_module(pipe.stages[1])}"


def first_module(stage: Any) -> str:
    from varuna_fx.ir.nodes import info

    paths = [info(n).module_path for n in stage.module.graph.nodes
             if n.op not in ("placeholder", "output", "get_attr") and info(n).module_path]
    return paths[0] if paths else "?"


def theirs(case: dict, schedule: str, m: int) -> tuple[Callable[[], float], str]:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

    model = copy.deepcopy(case["model"])
    mb = case["x"].shape[0] // m
    pipe = pipeline(model, mb_args=(case["x"][:mb],),
                    split_spec={case["split"]: SplitPoint.BEGINNING})
    rank = dist.get_rank()
    stage = pipe.build_stage(rank, torch.device("cpu"))
    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    sched = cls(stage, n_microbatches=m, loss_fn=case["loss"])
    params = list(stage.submod.parameters())

    def step() -> float:
        for p in params:
            p.grad = None
        if rank == 0:
            sched.step(case["x"], return_outputs=False)
            return float("nan")
        losses: list[torch.Tensor] = []
        sched.step(target=case["y"], losses=losses, return_outputs=False)
        return float(torch.stack(losses).mean())

    return step, f"middle: stage 1 from {case['split']}"


def measure(variants: list[tuple[str, Callable[[], float]]]) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    for it in range(WARMUP + TIMED):
        for name, step in variants:
            dist.barrier()
            start = time.perf_counter()
            step()
            dist.barrier()
            if it >= WARMUP:
                times[name].append(time.perf_counter() - start)
    return times


def worker(write: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    m = 8
    rows = []
    for case in make_models():
        built = {}
        for label, maker, sched in (("varuna_fx 1f1b", ours, "1f1b"),
                                    ("varuna_fx varuna", ours, "varuna"),
                                    ("pipelining Schedule1F1B", theirs, "1f1b"),
                                    ("pipelining ScheduleGPipe", theirs, "gpipe")):
            built[label] = maker(case, sched, m)
        times = measure([(label, step) for label, (step, _) in built.items()])
        med = {k: statistics.median(v) for k, v in times.items()}
        for label, (_, note) in built.items():
            ref = med["pipelining Schedule1F1B" if "1f1b" in label.lower()
                      else "pipelining ScheduleGPipe"]
            rows.append((case["name"], label, note, med[label], med[label] / ref))
    if dist.get_rank() == 0:
        report(rows, m, write)
    dist.barrier()
    dist.destroy_process_group()


def report(rows: list[tuple], m: int, write: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"P=2, m={m}, gloo, 2 processes x 1 thread, median of {TIMED} steps "
                        f"after {WARMUP} warm-up; ratio vs pipelining's same-kind schedule")
    for col in ("model", "system / schedule", "partition", "step (ms)", "ratio"):
        table.add_column(col, justify="left" if col in ("model", "system / schedule",
                                                         "partition") else "right")
    for name, label, note, t, ratio in rows:
        mark = "" if label.startswith("pipelining") else f"{ratio:.3f}"
        table.add_row(name, label, note, f"{t * 1e3:.1f}", mark)
    console = Console(width=140)
    console.print(table)
    if write:
        text = Console(width=140, record=True, file=open(os.devnull, "w"))
        text.print(table)
        write_block("bench_vs_pipelining.py",
                    f"Command: `{COMMAND}` (torch {torch.__version__}, {os.cpu_count()} CPU "
                    f"cores)\n\n```\n{text.export_text()}```\n\n{NOTES}")


def main() -> None:
    write = "--write" in sys.argv
    if "RANK" in os.environ:
        worker(write)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", __file__, *sys.argv[1:]]
    raise SystemExit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
