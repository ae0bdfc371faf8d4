"""What keying dropout per sample costs per step (issue 24 item 4).

Run: ``python bench/bench_dropout_keyed.py``. A small GPT (dropout 0.1 on embeddings, attention
output and MLP output: 3 x layers + 1 random ops), one process, P=2, global batch 16, for each
micro-batch size: the median step time with

* ``keyed``: what ships, every random op drawn row by row from (step seed, op, sample);
* ``one draw``: the same pipeline with each random op drawn once per micro-batch from a
  generator seeded by (step seed, op, micro-batch) -- the cost of the former scheme, whose
  masks changed with the micro-batch size (done here by replacing the per-row draw);
* ``no dropout``: the same model with dropout 0 (no random ops at all).

On an older tree (``PYTHONPATH`` at its ``src``) "keyed" is that tree's dropout (one reseed per
random node and micro-batch, no dispatch mode) and "one draw" is left out.

Steps are interleaved (rotating order) and the median CPU time (``time.process_time``, one
thread) of REPEATS is reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.ir import rng

REPEATS, WARMUP, BATCH = 15, 2, 16
CONFIG = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)


def one_draw(func: Any, args: tuple, kwargs: dict, batch: int, seeds: list[int]) -> Any:
    """The former cost: one generator seeding and one draw for the whole micro-batch."""
    rng._seed_device(args, kwargs, seeds[0])
    return func(*args, **kwargs)


def main() -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, CONFIG["block_size"] + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    keyed_draw = getattr(rng, "_per_row", None)  # None: an older tree (masks per micro-batch)
    print(f"GPT {CONFIG}, batch {BATCH}, P=2, one process, {torch.get_num_threads()} threads; "
          f"median CPU ms of {REPEATS} steps")
    print("| micro-batch | keyed | one draw | no dropout | keyed - one draw | "
          "keyed - no dropout |")
    print("| --- | --- | --- | --- | --- | --- |")
    for micro in (1, 2, 4, 8, 16):
        pipes = {}
        kinds = (("keyed", 0.1), ("one draw", 0.1), ("no dropout", 0.0)) if keyed_draw \
            else (("keyed", 0.1), ("no dropout", 0.0))
        for name, p in kinds:
            torch.manual_seed(0)
            model = GPT(GPTConfig(**CONFIG, dropout=p))
            pipes[name] = vf.compile(model, example_inputs=(x,), loss_fn=lm_loss, stages=2,
                                     micro_batch_size=micro, recompute=False)

        def step(name: str, pipe: vf.Pipeline) -> Callable[[], float]:
            def run() -> float:
                if keyed_draw is not None:
                    rng._per_row = one_draw if name == "one draw" else keyed_draw
                pipe.zero_grad()
                t = time.process_time()  # CPU time: steadier than wall on a shared machine
                pipe.step(x, target=y)
                return time.process_time() - t
            return run

        times: dict[str, list[float]] = {n: [] for n in pipes}
        names = list(pipes)
        for i in range(WARMUP + REPEATS):
            for name in names[i % len(names):] + names[:i % len(names)]:
                t = step(name, pipes[name])()
                if i >= WARMUP:
                    times[name].append(t)
        if keyed_draw is not None:
            rng._per_row = keyed_draw
        med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
        med.setdefault("one draw", float("nan"))
        print(f"| {micro} | {med['keyed']:.1f} | {med['one draw']:.1f} | "
              f"{med['no dropout']:.1f} | {med['keyed'] - med['one draw']:+.1f} | "
              f"{med['keyed'] - med['no dropout']:+.1f} |")


if __name__ == "__main__":
    main()
