"""Schedules side by side: simulated vs measured one-process step times, per schedule.

Run: ``OMP_NUM_THREADS=1 python bench/bench_schedule_step.py`` (``--quick`` for a smoke run,
``--write`` to put the tables into their block of ``bench/RESULTS.md``).

For each model (a GPT with a heavy LM head, a uniform MLP stack), P stages in one process and
each schedule (varuna, 1f1b, gpipe and the split-backward variants) with recompute off, on
(every stage but the last) and "auto", it reports:

* ``measured``: the median one-process step time. One process runs the stages one after
  another, so this is the total work of a step, including what the schedule adds (a recompute,
  the split backward's second pass) but no pipelining.
* ``sim 1-proc``: the simulator's total busy time with the plan's estimated costs (what the
  measured column should be if the cost model were right), and ``err`` its error.
* ``sim P dev``: the simulated step time on P devices, from the per-action times *measured*
  in this run (each F, R, B, W timed and averaged per stage), which is how the schedules
  compare once the stages run in parallel; ``vs 1f1b`` divides by 1F1B's (same recompute).

Variants run round-robin, one step each, so background load hits all alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from common import write_block  # noqa: E402

import varuna_fx as vf  # noqa: E402
from varuna_fx.examples import GPT, GPTConfig, lm_loss  # noqa: E402
from varuna_fx.runtime.worker import StageWorker  # noqa: E402
from varuna_fx.schedule import Kind, ScheduleCosts, simulate_costs  # noqa: E402

SCHEDULES = ["varuna", "1f1b", "gpipe", "varuna-zb", "1f1b-zb"]
RECOMPUTE: list[Any] = [False, True, "auto"]

# (stage index, kind) -> seconds of each timed action, filled by the timing wrappers
TIMES: dict[tuple[int, Kind], list[float]] = defaultdict(list)


def _timed(kind: Kind, method: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: StageWorker, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = method(self, *args, **kwargs)
        TIMES[(self.stage.index, kind)].append(time.perf_counter() - start)
        return out
    return wrapper


def instrument() -> None:
    """Time every worker action (bench only: the wrappers add a clock read per action)."""
    StageWorker.forward = _timed(Kind.F, StageWorker.forward)  # type: ignore[method-assign]
    StageWorker.recompute_mb = _timed(Kind.R, StageWorker.recompute_mb)  # type: ignore
    StageWorker.backward = _timed(Kind.B, StageWorker.backward)  # type: ignore[method-assign]
    StageWorker.weight_grads = _timed(Kind.W, StageWorker.weight_grads)  # type: ignore


class MLP(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU())
                                      for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def models(quick: bool) -> dict[str, tuple[nn.Module, tuple, torch.Tensor, Callable]]:
    torch.manual_seed(0)
    vocab, width, batch = (2048, 64, 16) if quick else (16384, 256, 32)
    gpt = GPT(GPTConfig(vocab_size=vocab, block_size=32, n_layer=4, n_head=4, n_embd=width))
    tokens = torch.randint(0, vocab, (batch, 33))
    mlp_width = 128 if quick else 1024
    mlp = MLP(mlp_width, 8)
    x = torch.randn(batch, mlp_width)
    return {
        "gpt-heavy-head": (gpt, (tokens[:, :-1],), tokens[:, 1:], lm_loss),
        "mlp-8x": (mlp, (x,), torch.randn(batch, mlp_width), nn.functional.mse_loss),
    }


def measured_costs(p: int, steps: int) -> ScheduleCosts:
    """Mean measured seconds per action, per stage (B of a split schedule: B + W is the whole
    backward, W its weight part)."""
    def mean(s: int, k: Kind) -> float:
        vals = TIMES.get((s, k), [])
        return sum(vals) / len(vals) if vals else 0.0
    fwd = [mean(s, Kind.F) for s in range(p)]
    rec = [mean(s, Kind.R) or fwd[s] for s in range(p)]
    wgt = [mean(s, Kind.W) for s in range(p)]
    bwd = [mean(s, Kind.B) + wgt[s] for s in range(p)]
    return ScheduleCosts.of(fwd, bwd, recompute=rec, weight_grad=wgt)


def bench(quick: bool) -> str:
    instrument()
    p, m, steps = (3, 4, 2) if quick else (4, 4, 5)
    lines = ["| model | schedule | recompute | measured ms | sim 1-proc ms | err | "
             "sim P dev ms | vs 1f1b |", "|---|---|---|---|---|---|---|---|"]
    for name, (model, inputs, target, loss_fn) in models(quick).items():
        batch = inputs[0].shape[0]
        pipes = {}
        for sched in SCHEDULES:
            for rc in RECOMPUTE:
                pipes[(sched, rc)] = vf.compile(model, example_inputs=inputs, loss_fn=loss_fn,
                                                stages=p, schedule=sched, recompute=rc,
                                                micro_batch_size=batch // m)
        walls: dict[Any, list[float]] = defaultdict(list)
        action_times: dict[Any, dict] = defaultdict(lambda: defaultdict(list))
        for pipe in pipes.values():  # warm-up
            pipe.step(*inputs, target=target)
        for _ in range(steps):
            for key, pipe in pipes.items():
                TIMES.clear()
                pipe.zero_grad()
                start = time.perf_counter()
                pipe.step(*inputs, target=target)
                walls[key].append(time.perf_counter() - start)
                for k, v in TIMES.items():
                    action_times[key][k] += v
        rows = {}
        for key, pipe in pipes.items():
            TIMES.clear()
            TIMES.update(action_times[key])
            plan = pipe.plan
            costs = plan.stage_costs
            est = ScheduleCosts.of([c.forward_time for c in costs],
                                   [c.backward_time for c in costs])
            sim_busy = sum(simulate_costs(plan.schedule, est).busy)
            real = measured_costs(p, steps)
            rows[key] = (statistics.median(walls[key]), sim_busy,
                         simulate_costs(plan.schedule, real).step_time)
        for (sched, rc), (wall, busy, par) in rows.items():
            base = rows[("1f1b", rc)][2]
            lines.append(f"| {name} | {sched} | {rc} | {wall * 1e3:.1f} | {busy * 1e3:.1f} | "
                         f"{busy / wall - 1:+.0%} | {par * 1e3:.1f} | {par / base:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, 2 steps (smoke)")
    parser.add_argument("--write", action="store_true",
                        help="put the tables into bench/RESULTS.md (replacing the last run's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    table = bench(args.quick)
    print(table)
    if args.write:
        quick = " --quick" if args.quick else ""
        write_block("bench_schedule_step.py",
                    f"Command: `OMP_NUM_THREADS=1 python bench/bench_schedule_step.py{quick} "
                    f"--write` ({'a smoke run' if args.quick else 'the full run'})\n\n{table}")


if __name__ == "__main__":
    main()
