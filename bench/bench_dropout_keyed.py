"""What keying dropout per sample costs per step (issue 24 item 4; issue 30).

Run: ``OMP_NUM_THREADS=1 python bench/bench_dropout_keyed.py [--micro 1 2 4 8 16] [--repeats 15]``
(``--ops``: one dropout call keyed and not, per shape, instead of whole steps).
A small GPT (dropout 0.1 on embeddings, attention output and MLP output: 3 x layers + 1 random
ops), one process, P=2, global batch 16, for each micro-batch size: the median step time with

* ``keyed``: what ships, every random op drawn row by row from (step seed, op, sample);
* ``plain``: the same pipeline with the keying switched off (the workers' ``rng_context``
  replaced by a no-op: dropout draws from the global generator, as eager's does, and its masks
  change with the layout): what dropout costs anyway;
* ``no dropout``: the same model with dropout 0 (no random ops at all).

``keyed - plain`` is the price of layout-independent masks; the table gives it in ms and as a
share of the plain step. Another tree (``PYTHONPATH`` at its ``src``) runs the same way, so the
before and after of a change are two runs of this script.

Steps are interleaved (rotating order) and the median CPU time (``time.process_time``, one
thread) of REPEATS is reported: CPU time, not wall, because the machine is shared.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.runtime import worker

WARMUP, BATCH = 2, 16
CONFIG = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)


@contextlib.contextmanager
def unkeyed(key: Any, mb: int) -> Iterator[None]:
    """The workers' rng_context with no key: random ops draw as in eager."""
    yield


def op_costs(repeats: int) -> None:
    """One dropout call keyed (what the stage code calls) against ``F.dropout``, on the bench
    GPT's two dropout shapes (attention probabilities, activations), interleaved: the step's
    extra is the sum over its calls, with less noise than whole steps."""
    from varuna_fx.ir.keyed_calls import keyed_dropout
    from varuna_fx.ir.rng import RandomKey, rng_context

    def once(f: Callable[[], Any], n: int = 20) -> float:
        t = time.process_time()
        for _ in range(n):
            f()
        return (time.process_time() - t) / n * 1e6

    print("| rows x shape | keyed us | F.dropout us | extra us |")
    print("| --- | --- | --- | --- |")
    heads, t, d = CONFIG["n_head"], CONFIG["block_size"], CONFIG["n_embd"]
    for b in (1, 4, 16):
        for shape in ((b, heads, t, t), (b, t, d)):
            x = torch.randn(shape)
            keyed, plain = [], []
            with rng_context(RandomKey(1, 0, b), 0):
                for _ in range(repeats):
                    keyed.append(once(lambda x=x: keyed_dropout(0, (True,), x, 0.1, True)))
                    plain.append(once(lambda x=x: torch.nn.functional.dropout(x, 0.1, True)))
            k, p = statistics.median(keyed), statistics.median(plain)
            print(f"| {shape} | {k:.0f} | {p:.0f} | {k - p:+.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--ops", action="store_true", help="one dropout call, keyed and not")
    args = parser.parse_args()
    if args.ops:
        op_costs(2 * args.repeats)
        return
    torch.manual_seed(0)
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, CONFIG["block_size"] + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    keyed_context = worker.rng_context
    print(f"GPT {CONFIG}, batch {BATCH}, P=2, one process, {torch.get_num_threads()} threads; "
          f"median CPU ms of {args.repeats} steps ({vf.__file__})")
    print("| micro-batch | keyed | plain | no dropout | keyed - plain | (% of plain) | "
          "plain - no dropout |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for micro in args.micro:
        pipes = {}
        for name, p in (("keyed", 0.1), ("plain", 0.1), ("no dropout", 0.0)):
            torch.manual_seed(0)
            model = GPT(GPTConfig(**CONFIG, dropout=p))
            pipes[name] = vf.compile(model, example_inputs=(x,), loss_fn=lm_loss, stages=2,
                                     micro_batch_size=micro, recompute=False)

        def step(name: str, pipe: vf.Pipeline) -> Callable[[], float]:
            def run() -> float:
                worker.rng_context = unkeyed if name == "plain" else keyed_context
                pipe.zero_grad()
                t = time.process_time()  # CPU time: steadier than wall on a shared machine
                pipe.step(x, target=y)
                return time.process_time() - t
            return run

        times: dict[str, list[float]] = {n: [] for n in pipes}
        names = list(pipes)
        for i in range(WARMUP + args.repeats):
            for name in names[i % len(names):] + names[:i % len(names)]:
                t = step(name, pipes[name])()
                if i >= WARMUP:
                    times[name].append(t)
        worker.rng_context = keyed_context
        med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
        extra = med["keyed"] - med["plain"]
        print(f"| {micro} | {med['keyed']:.1f} | {med['plain']:.1f} | {med['no dropout']:.1f} | "
              f"{extra:+.1f} | {100 * extra / med['plain']:+.1f}% | "
              f"{med['plain'] - med['no dropout']:+.1f} |", flush=True)


if __name__ == "__main__":
    from results import recorded

    with recorded("bench_dropout_keyed.py"):
        main()
