"""ZeRO-1 (sharded optimizer state) against the plain all-reduce: 2 gloo ranks, P=1, D=2.

Usage: ``python bench/bench_zero1.py [--steps N] [--layers L] [--width W]``. For each mode
(``shard_optimizer=False``: bucketed all-reduce + a full AdamW per rank; ``True``: the same
all-reduce, AdamW on this rank's shard, all-gather) it launches 2 ranks (plain subprocesses with torchrun's
environment) training a float32 GPT, and reports per rank:

* bytes sent per step by NCCL's ring algorithm for the collectives this runtime issues
  (all-reduce: 2 (D-1)/D n; sharded adds the all-gather's (D-1)/D n), counted from the
  buffers actually handed to them (padding included);
* bytes gloo actually wrote to its sockets per step: the process's ``wchar`` (/proc/self/io)
  around each step (it counts every write(2); nothing else writes during a step);
* the median step time (zero_grad + step + optimizer step) and the ratio sharded / plain;
  the modes alternate for ``--rounds`` rounds (the machine is shared: compare within a round);
* the optimizer's state bytes on the rank, the rank's peak RSS (ru_maxrss, compile included)
  and its resident set after the steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2


def wchar() -> int:
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["wchar"])


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def model_state(pipe, opt: torch.optim.Optimizer) -> int:  # noqa: ANN001
    """Bytes of the tensors training keeps between steps: parameters, their gradients, the
    optimizer's state and (sharded) the shards' averaged gradients."""
    from varuna_fx.runtime.sync.zero import shard_state_bytes

    def size(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    total = sum(size(p) + size(p.grad) for p in pipe.parameters())
    zero = pipe.runtime.grad_sync.zero
    total += sum(size(b.shard.grad) for b in zero.layout.buckets) if zero is not None else 0
    return total + shard_state_bytes(opt)


def rank_main(out: Path, mode: str, steps: int, layers: int, width: int) -> None:
    import varuna_fx as vf
    from varuna_fx.examples import GPT, GPTConfig, lm_loss
    from varuna_fx.runtime.sync.zero import shard_state_bytes

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=2048, block_size=16, n_layer=layers, n_head=8, n_embd=width)
    data = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1))  # global batch 4
    pipe = vf.compile(GPT(cfg), example_inputs=(data[:2, :-1],), loss_fn=lm_loss, stages=1,
                      data_parallel=WORLD, micro_batch_size=2,
                      shard_optimizer=mode == "sharded")
    opt = pipe.optimizer(torch.optim.AdamW, lr=1e-4)
    sync = pipe.runtime.grad_sync
    grad_bytes = sum(p.numel() * p.element_size() for p in sync.held.values())
    x, y = pipe.shard((data[:, :-1], data[:, 1:]))
    times, wire, ring, optimizer_s = [], [], [], []
    for step in range(steps + 2):
        before = (time.perf_counter(), wchar(), sync.zero.ring_bytes if sync.zero else 0)
        pipe.zero_grad()
        pipe.step(x, target=y)
        stepped = time.perf_counter()
        opt.step()
        after = (time.perf_counter(), wchar(), sync.zero.ring_bytes if sync.zero else 0)
        if step >= 2:  # two warm-up steps
            times.append(after[0] - before[0])
            optimizer_s.append(after[0] - stepped)
            wire.append(after[1] - before[1])
            ring.append(after[2] - before[2] + 2 * (WORLD - 1) * grad_bytes // WORLD)
    result = {"rank": pipe.replica_index, "mode": mode, "grad_bytes": grad_bytes,
              "step_s": statistics.median(times), "wire": statistics.median(wire),
              "optimizer_s": statistics.median(optimizer_s), "model_state": model_state(pipe, opt),
              "ring": statistics.median(ring), "state_bytes": shard_state_bytes(opt),
              "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "rss_after": resident()}
    (out / f"{mode}_{pipe.replica_index}.json").write_text(json.dumps(result))
    pipe.close()
    sys.stdout.flush()
    os._exit(0)


def launch(out: Path, mode: str, args: argparse.Namespace) -> list[dict]:
    from common import free_port, rank_env

    port = free_port()
    procs = []
    for r in range(WORLD):
        env = rank_env(r, WORLD, port,
                       PYTHONPATH=f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}")
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--rank-of", str(out), mode, "--steps", str(args.steps),
             "--layers", str(args.layers), "--width", str(args.width)], env=env))
    for p in procs:
        if p.wait(timeout=900) != 0:
            raise SystemExit(f"a rank of the {mode} run failed")
    return [json.loads((out / f"{mode}_{r}.json").read_text()) for r in range(WORLD)]


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank-of", nargs=2, metavar=("OUT", "MODE"))
    args = parser.parse_args()
    if args.rank_of:
        rank_main(Path(args.rank_of[0]), args.rank_of[1], args.steps, args.layers, args.width)
        return
    rounds = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            rounds.append({mode: launch(Path(tmp), mode, args) for mode in ("plain", "sharded")})
    plain, sharded = rounds[0]["plain"], rounds[0]["sharded"]
    print(f"GPT {args.layers} x {args.width}, float32, {plain[0]['grad_bytes'] / 2**20:.1f} MiB "
          f"of gradients per rank, P=1 x D=2 on gloo, {args.steps} timed steps (median)\n")
    ratios = [statistics.median(one["sharded"][r]["step_s"] / one["plain"][r]["step_s"]
                                for r in range(WORLD)) for one in rounds]
    print("step time sharded / plain per round (median over ranks): "
          + ", ".join(f"{x:.3f}" for x in ratios)
          + "; ms plain / sharded: " + ", ".join(
              f"{1e3 * one['plain'][0]['step_s']:.0f} / {1e3 * one['sharded'][0]['step_s']:.0f}"
              for one in rounds) + "\n")
    print("| per rank | plain all-reduce | sharded (ZeRO-1) | sharded / plain |")
    print("|---|---|---|---|")
    for r in range(WORLD):
        a, b = plain[r], sharded[r]
        rows = [("bytes sent / step, NCCL ring", a["ring"], b["ring"], mib),
                ("bytes gloo wrote / step", a["wire"], b["wire"], mib),
                ("step time", a["step_s"], b["step_s"], lambda t: f"{t * 1e3:.1f} ms"),
                ("of which opt.step()", a["optimizer_s"], b["optimizer_s"],
                 lambda t: f"{t * 1e3:.1f} ms"),
                ("model state kept between steps", a["model_state"], b["model_state"], mib),
                ("optimizer state", a["state_bytes"], b["state_bytes"], mib),
                ("peak RSS", a["peak_rss"], b["peak_rss"], mib),
                ("RSS after the steps", a["rss_after"], b["rss_after"], mib)]
        for name, x, y, fmt in rows:
            print(f"| rank {r}: {name} | {fmt(x)} | {fmt(y)} | {y / x:.3f} |")


if __name__ == "__main__":
    from results import recorded

    with recorded("bench_zero1.py"):
        main()
