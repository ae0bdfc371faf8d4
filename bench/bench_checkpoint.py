"""Checkpoint throughput against plain torch.save / torch.load, and the cost of an async save.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/bench_checkpoint.py            # ~100M GPT
    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/bench_checkpoint.py --small    # smoke test
    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/bench_checkpoint.py --checksums-only

``--checksums-only`` measures only what the per-entry CRC-32 costs (format 4): saves with and
without computing it, loads with and without verifying it (a checkpoint saved without
checksums loads unverified), interleaved, and zlib.crc32's own throughput over the state's
bytes in memory.

One process, one GPT (fp32) after one AdamW step, so the state is model + two moments (~3x
the parameters). Rows of one run compare side by side (interleaved, median of ``--repeats``);
each row also gives the CPU seconds of the process (all threads) -- on a shared machine the
wall time includes waiting for the CPU and the disk, the CPU seconds do not. The load average
is printed before and after.

What each side does:

* ``torch.save``: one file holding ``{"model": sd, "optim": opt.state_dict()}`` (the same
  tensors; torch's zip format, one record per tensor), ``flush`` and ``os.fsync`` of that file
  (a checkpoint that is not on disk does not survive a crash).
  ``pipe.save_checkpoint``: DCP planning, the same tensors keyed by FQN written as raw bytes
  into 4 files (one per writer thread), each fsynced, DCP's metadata file (fsynced), our marker
  file (fsynced), the rename of ``<path>.partial`` and an fsync of the parent directory.
* ``torch.load(weights_only=True)``: reads the file into new tensors.
  ``pipe.load_checkpoint``: checks the checkpoint against the model, reads the model's tensors
  straight into the model's own parameters and the optimizer state into new tensors, rebuilds
  the optimizer's state dict, restores RNG and loss scale. Both read files that were just
  written, i.e. mostly from the page cache.

The ratio is torch's time / ours (>= 0.8 is the target). Async save: mean step time without a
save, the time ``save_checkpoint(async_save=True)`` blocks (copy to host memory), and the mean
step time while the background write runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch
from common import median_seconds
from rich.console import Console
from rich.table import Table

import varuna_fx as vf
from varuna_fx.checkpoint import save_load
from varuna_fx.checkpoint.raw_storage import RawWriter, byte_view
from varuna_fx.examples import GPT, GPTConfig, lm_loss


def build(small: bool) -> tuple[vf.Pipeline, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    cfg = (GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=64) if small
           else GPTConfig(vocab_size=50304, block_size=128, n_layer=8, n_head=8, n_embd=768))
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1))
    pipe = vf.compile(model, example_inputs=(tokens[:, :-1],), loss_fn=lm_loss, stages=2,
                      micro_batch_size=2)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    step(pipe, opt, tokens)
    return pipe, opt, tokens


def step(pipe: vf.Pipeline, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    pipe.zero_grad()
    pipe.step(tokens[:, :-1], target=tokens[:, 1:])
    opt.step()


def timed_cpu(fn) -> tuple[float, float]:  # noqa: ANN001
    """Wall seconds and CPU seconds of this process (every thread) for one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def settle(seconds: float = 2.0) -> None:
    """Before each timed operation: flush what the OS still holds and let the disk finish the
    previous operation's writes (a virtual disk keeps writing after fsync returns), so that no
    operation pays for the one before it."""
    os.sync()
    time.sleep(seconds)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def torch_save(obj: dict, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def checksum_cost(pipe: vf.Pipeline, opt: torch.optim.Optimizer, root: Path, repeats: int,
                  console: Console) -> None:
    """Save and load with and without the per-entry CRC-32, interleaved; crc32's speed."""
    tensors = [t.detach().contiguous() for t in pipe.state_dict().values()]
    tensors += [v.contiguous() for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    start, cpu = time.perf_counter(), time.process_time()
    for t in tensors:
        zlib.crc32(byte_view(t))
    crc_s, crc_cpu = time.perf_counter() - start, time.process_time() - cpu
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in
                                                   ("save_on", "save_off", "load_on",
                                                    "load_off")}
    for i in range(repeats):
        order = ("on", "off") if i % 2 == 0 else ("off", "on")
        for mode in order:
            RawWriter.checksums = mode == "on"  # off: what format 2 wrote
            save_load.FORMAT = 4 if mode == "on" else 2
            settle()
            times[f"save_{mode}"].append(timed_cpu(lambda m=mode, i=i: pipe.save_checkpoint(
                str(root / f"crc_{m}{i}"), optimizer=opt)))
        RawWriter.checksums, save_load.FORMAT = True, 4
        for mode in order:
            settle()
            times[f"load_{mode}"].append(timed_cpu(lambda m=mode, i=i: pipe.load_checkpoint(
                str(root / f"crc_{m}{i}"), optimizer=opt)))
        for mode in order:
            shutil.rmtree(root / f"crc_{mode}{i}")
    table = Table(title=f"per-entry CRC-32 (format 3) on {nbytes / 1e9:.2f} GB of model + "
                  f"AdamW state, median of {repeats}")
    for col in ("operation", "with s", "without s", "cost s", "cost %", "with CPU s",
                "without CPU s"):
        table.add_column(col, justify="right")
    for what in ("save", "load"):
        on = statistics.median(w for w, _ in times[f"{what}_on"])
        off = statistics.median(w for w, _ in times[f"{what}_off"])
        on_cpu = statistics.median(c for _, c in times[f"{what}_on"])
        off_cpu = statistics.median(c for _, c in times[f"{what}_off"])
        table.add_row(what, f"{on:.3f}", f"{off:.3f}", f"{on - off:+.3f}",
                      f"{(on / off - 1) * 100:+.0f}%", f"{on_cpu:.3f}", f"{off_cpu:.3f}")
    console.print(table)
    console.print(f"  zlib.crc32 over the same bytes in memory, one thread: {crc_s:.3f} s wall, "
                  f"{crc_cpu:.3f} s CPU ({nbytes / 1e9 / crc_cpu:.2f} GB per CPU second)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a tiny model (smoke test)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--checksums-only", action="store_true",
                        help="only the cost of the per-entry checksums")
    args = parser.parse_args()
    console = Console(width=140)
    console.print(f"load average at start: {load_average()} ({os.cpu_count()} CPUs)")
    pipe, opt, tokens = build(args.small)
    if args.checksums_only:
        root = Path(tempfile.mkdtemp(prefix="vf_bench_crc_", dir=args.dir))
        try:
            checksum_cost(pipe, opt, root, args.repeats, console)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        console.print(f"load average at the end: {load_average()}")
        return
    state = {n: t.detach() for n, t in pipe.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    nbytes += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor))
    root = Path(tempfile.mkdtemp(prefix="vf_bench_ckpt_", dir=args.dir))
    try:
        # interleaved, so both see the same load from other jobs on a shared machine, and
        # in alternating order (torch first, then ours first), so neither always runs in the
        # wake of the other's disk writes; every save goes to a fresh path (deleting the
        # previous one is not timed)
        times: dict[str, list[tuple[float, float]]] = {"t_save": [], "t_load": [], "v_save": [],
                                                       "v_load": []}
        for i in range(args.repeats):
            plain, ours = root / f"plain{i}.pt", root / f"ckpt{i}"
            saves = [("t_save", lambda p=plain: torch_save(
                         {"model": state, "optim": opt.state_dict()}, p)),
                     ("v_save", lambda p=ours: pipe.save_checkpoint(
                         str(p), optimizer=opt, extra={"step": 1}))]
            loads = [("t_load", lambda p=plain: torch.load(p, weights_only=True)),
                     ("v_load", lambda p=ours: pipe.load_checkpoint(str(p), optimizer=opt))]
            for key, fn in [*saves[::1 - 2 * (i % 2)], *loads[::1 - 2 * (i % 2)]]:
                settle()
                times[key].append(timed_cpu(fn))
            plain.unlink()
            shutil.rmtree(ours)
        wall = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
        cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
        t_save, v_save, t_load, v_load = (wall[k] for k in ("t_save", "v_save", "t_load",
                                                             "v_load"))

        steps = 3 if args.small else 5
        base = median_seconds(lambda: step(pipe, opt, tokens), steps)
        block, during = [], []
        for i in range(args.repeats):
            start = time.perf_counter()
            handle = pipe.save_checkpoint(str(root / f"async{i}"), optimizer=opt,
                                          async_save=True)
            block.append(time.perf_counter() - start)
            while not handle.done():
                start = time.perf_counter()
                step(pipe, opt, tokens)
                during.append(time.perf_counter() - start)
            handle.result()
            shutil.rmtree(root / f"async{i}")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    gb = nbytes / 1e9
    table = Table(title=f"checkpoint of a {sum(t.numel() for t in state.values()) / 1e6:.1f}M-"
                  f"parameter GPT + AdamW state ({gb:.2f} GB), median of {args.repeats}")
    for col in ("operation", "torch s", "varuna_fx s", "torch GB/s", "varuna_fx GB/s",
                "ratio (>= 0.8)", "torch CPU s", "varuna_fx CPU s"):
        table.add_column(col, justify="right")
    for what, t, v in (("save", t_save, v_save), ("load", t_load, v_load)):
        table.add_row(what, f"{t:.3f}", f"{v:.3f}", f"{gb / t:.2f}", f"{gb / v:.2f}",
                      f"{t / v:.2f}", f"{cpu['t_' + what]:.3f}", f"{cpu['v_' + what]:.3f}")
    console.print(table)
    for key, label in (("t_save", "torch.save"), ("v_save", "save_checkpoint"),
                       ("t_load", "torch.load"), ("v_load", "load_checkpoint")):
        walls = [w for w, _ in times[key]]
        console.print(f"  {label:16s} wall s, every repeat: " + " ".join(f"{w:.2f}" for w in walls)
                      + f"; fastest {min(walls):.2f}")
    console.print("  (repeats alternate which side goes first; on a shared disk single times "
                  "vary several-fold, the fastest repeat is the least disturbed)")
    mean_during = statistics.mean(during) if during else float("nan")
    console.print(
        f"async save: step {base:.3f} s without a save; save_checkpoint(async_save=True) "
        f"blocks {statistics.median(block):.3f} s (sync save {v_save:.3f} s); steps while it "
        f"writes {mean_during:.3f} s ({len(during)} steps, "
        f"{(mean_during / base - 1) * 100:+.0f}% step time)")
    console.print(f"load average at the end: {load_average()}")


if __name__ == "__main__":
    from results import recorded

    with recorded("bench_checkpoint.py"):
        main()
