"""What the per-step model-edit check costs (``model_edits.ModelEdits.check``), beside a step.

Run: ``OMP_NUM_THREADS=1 python bench/bench_edit_check.py``. Model: the shipped GPT with 12
layers (d=32, so the step is small and the check's share is an upper bound for real models),
4 stages, micro-batch 4 of a batch of 8, both tracers (torch.export traces every module, so
it checks about 5x the modules fx does). The check walks every traced module's plain settings,
hooks and other attributes (by identity), the classes of those modules, and every object the
stages hold; it runs once per ``pipe.step``/``pipe(...)``. Prints the median of several
repetitions of each, in one run, and the check's share of the step.
"""

from __future__ import annotations

import statistics
import timeit
import warnings
from collections.abc import Callable

import torch

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig, lm_loss


def median_seconds(fn: Callable[[], object], number: int, repeat: int = 7) -> float:
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) / number


def main() -> None:
    warnings.simplefilter("ignore")
    print(f"{'tracer':8} {'traced modules':>15} {'classes':>8} {'check ms':>9} "
          f"{'step ms':>8} {'share':>7}")
    for tracer in ("fx", "export"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=12, n_head=2, n_embd=32))
        tokens = torch.randint(0, 128, (8, 17))
        x, y = tokens[:, :-1], tokens[:, 1:]
        pipe = vf.compile(model, example_inputs=(x,), loss_fn=lm_loss, stages=4,
                          micro_batch_size=4, tracer=tracer)
        edits = pipe._edits
        check = median_seconds(edits.check, number=200)
        step = median_seconds(lambda p=pipe, x=x, y=y: p.step(x, target=y), number=3)
        print(f"{tracer:8} {len(edits.settings):>15} {len(edits.classes):>8} "
              f"{check * 1e3:>9.3f} {step * 1e3:>8.1f} {check / step:>7.2%}")


if __name__ == "__main__":
    from results import recorded

    with recorded("bench_edit_check.py"):
        main()
