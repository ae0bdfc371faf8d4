"""Runtime overhead of a P=1 pipeline against plain eager forward + backward.

Run: ``python bench/bench_overhead.py`` (``--profile gpt|tiny``: cProfile of our step).
P=1, one micro-batch (micro_batch_size = batch), recompute off; the eager step is
``loss_fn(model(x), y).backward()`` on the very same parameters. For information also P=1 with
recompute on, and P=2 (one process, both stages) with recompute off / on. Steps are interleaved
(rotating order), gradients are zeroed outside the timed region, and the median is reported.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig, lm_loss

REPEATS, WARMUP = 40, 3
Case = tuple[nn.Module, torch.Tensor, torch.Tensor, Callable[..., torch.Tensor]]


def gpt_case() -> Case:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=4, n_embd=256, n_head=4, vocab_size=1000, block_size=128)
    tokens = torch.randint(0, cfg.vocab_size, (8, cfg.block_size + 1))
    return GPT(cfg), tokens[:, :-1], tokens[:, 1:], lm_loss


def mlp_case(width: int = 1024, batch: int = 64) -> Case:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)]
    return nn.Sequential(*layers), torch.randn(batch, width), torch.randn(batch, width), F.mse_loss


VARIANTS = {"ours": (1, False), "ours+rc": (1, True), "P=2": (2, False), "P=2+rc": (2, True)}


def step_fns(case: Case) -> dict[str, Callable[[], object]]:
    model, x, y, loss_fn = case

    def ours(stages: int, rc: bool) -> Callable[[], object]:
        pipe = vf.compile(model, vf.Cluster(gpus=stages, device="cpu"), (x,), loss_fn=loss_fn,
                          stages=stages, micro_batch_size=x.shape[0], recompute=rc, tracer="fx")
        return lambda: pipe.step(x, target=y)

    def eager() -> object:
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    return {"eager": eager, **{k: ours(*v) for k, v in VARIANTS.items()}}


def measure(case: Case) -> tuple[dict[str, float], dict[str, float]]:
    """Median time of each variant, and the median over rounds of its time / eager's time in
    the same round (paired: robust to the slow drifts of a shared machine)."""
    fns = step_fns(case)
    model = case[0]
    samples: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(WARMUP + REPEATS):
        k = r % len(names)
        for name in names[k:] + names[:k]:  # rotate who goes first
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            fns[name]()
            if r >= WARMUP:
                samples[name].append(time.perf_counter() - start)
    ratios = {k: statistics.median(a / e for a, e in zip(v, samples["eager"]))
              for k, v in samples.items()}
    return {k: statistics.median(v) for k, v in samples.items()}, ratios


def profile(which: str, steps: int = 500) -> None:
    fns = step_fns(gpt_case() if which == "gpt" else mlp_case(64, 8))
    for _ in range(WARMUP):
        fns["ours"]()
    prof = cProfile.Profile()
    prof.runcall(lambda: [fns["ours"]() for _ in range(steps)])
    stats = pstats.Stats(prof).strip_dirs().sort_stats("tottime")
    print(f"cProfile of {steps} P=1 {which} steps (per-step = tottime / {steps}):")
    stats.print_stats(25)


def main() -> None:
    torch.set_num_threads(1)  # the 2 cores are shared: one thread is far less noisy
    table = Table(title=f"One micro-batch, 1 thread: ours vs eager ({REPEATS} interleaved rounds; "
                        "ratios are medians of per-round ratios)")
    for col in ["model", "eager ms", "P=1 ms", "P=1/eager", "overhead µs", "P=1+rc/eager",
                "P=2/eager", "P=2+rc/eager"]:
        table.add_column(col, justify="right")
    cases = {"GPT 4x256, 8x128 tok": gpt_case, "MLP 4x(1024-4096-1024), b=64": mlp_case,
             "MLP 4x(64-256-64), b=8": lambda: mlp_case(64, 8)}
    for label, make in cases.items():
        t, r = measure(make())
        e = t["eager"]
        table.add_row(label, f"{e * 1e3:.2f}", f"{t['ours'] * 1e3:.2f}", f"{r['ours']:.3f}",
                      f"{(t['ours'] - e) * 1e6:.0f}",
                      *(f"{r[k]:.3f}" for k in ("ours+rc", "P=2", "P=2+rc")))
    Console(width=130).print(table)


if __name__ == "__main__":
    import sys

    from results import recorded

    with recorded("bench_overhead.py", part="profile" if "--profile" in sys.argv else None):
        parser = argparse.ArgumentParser()
        parser.add_argument("--profile", choices=["gpt", "tiny"])
        args = parser.parse_args()
        if args.profile:
            profile(args.profile)
        else:
            main()
