"""How steady this machine's own speed is: the noise floor under every timing in bench/.

Run: ``python bench/bench_machine_noise.py`` (``--samples 12 --interval 1``; about 30 s).
One process, one thread, nothing of varuna_fx: the same fixed kernels timed again and again
(CPU time, so a process that lost its core does not count), a second apart. If a kernel's
CPU time moves by tens of percent here, no simulator can be checked against two-rank steps
on this machine to 5%: its prediction comes from a profile taken seconds to minutes earlier.
Kernels: a small matmul (128 x 1024 by 1024 x 1024, fits in cache), a large one (2048^3),
copying 64 MiB (memory bandwidth) and an MLP-like chain (8 x [256 x 1024 by 1024 x 1024 +
relu], the shape of ``bench_network.py``'s uniform MLP). ``--neighbours 1`` keeps another
process running the MLP-like chain meanwhile, as the second rank of a two-rank run would.
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.synchronize
import os
import statistics
import time
from collections.abc import Callable

import torch
from common import median_seconds
from rich.console import Console
from rich.table import Table


def cpu_ms(fn: Callable[[], object], repeat: int) -> float:
    """Median CPU milliseconds of ``repeat`` calls."""
    return 1e3 * median_seconds(fn, repeat, clock=time.process_time)


def kernels() -> dict[str, tuple[Callable[[], object], int]]:
    generator = torch.Generator().manual_seed(0)
    small = torch.randn(128, 1024, generator=generator), torch.randn(1024, 1024,
                                                                      generator=generator)
    large = torch.randn(2048, 2048, generator=generator), torch.randn(2048, 2048,
                                                                       generator=generator)
    source = torch.randn(16 * 1024 * 1024, generator=generator)
    target = torch.empty_like(source)
    weight, batch = torch.randn(1024, 1024, generator=generator), torch.randn(
        256, 1024, generator=generator)

    def mlp() -> torch.Tensor:
        h = batch
        for _ in range(8):
            h = torch.relu(h @ weight)
        return h

    return {"small matmul": (lambda: small[0] @ small[1], 5),
            "large matmul": (lambda: large[0] @ large[1], 2),
            "copy 64 MiB": (lambda: target.copy_(source), 5),
            "MLP-like chain": (mlp, 5)}


def neighbour(stop: multiprocessing.synchronize.Event) -> None:
    torch.set_num_threads(1)
    fn, _ = kernels()["MLP-like chain"]
    while not stop.is_set():
        fn()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--neighbours", type=int, default=0,
                        help="processes computing alongside (one core each)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    others = [context.Process(target=neighbour, args=(stop,)) for _ in range(args.neighbours)]
    for process in others:
        process.start()
    try:
        samples = sample(args)
    finally:
        stop.set()
        for process in others:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    table = Table(title=f"{args.samples} samples {args.interval:g} s apart, CPU ms (median of "
                        f"each sample's repeats), {args.neighbours} neighbour(s); load average "
                        f"{load:.1f} -> {os.getloadavg()[0]:.1f}")
    for column in ("kernel", "median", "least", "most", "most / least", "samples"):
        table.add_column(column, justify="left" if column in ("kernel", "samples") else "right")
    for name, values in samples.items():
        table.add_row(name, f"{statistics.median(values):.2f}", f"{min(values):.2f}",
                      f"{max(values):.2f}", f"{max(values) / min(values):.2f}",
                      " ".join(f"{v:.1f}" for v in values))
    Console(width=200).print(table)


def sample(args: argparse.Namespace) -> dict[str, list[float]]:
    work = kernels()
    for fn, repeat in work.values():  # warm up
        cpu_ms(fn, repeat)
    samples: dict[str, list[float]] = {name: [] for name in work}
    for k in range(args.samples):
        for name, (fn, repeat) in work.items():
            samples[name].append(cpu_ms(fn, repeat))
        if k + 1 < args.samples:
            time.sleep(args.interval)
    return samples

if __name__ == "__main__":
    from results import recorded

    with recorded("bench_machine_noise.py"):
        main()
