"""What the capture cache saves when re-compiling an unchanged model (another P).

Run: ``python bench/bench_capture_cache.py``. The cache captures the model afresh on every
compile and reuses the annotated graph only when that capture is identical (so it can never
return a stale graph); it skips the fake-tensor runs and cost passes. Per GPT size: a compile
with the cache emptied ("fresh"), a re-compile hitting it ("cached"), and capture alone (the
price of checking), medians of 3.
"""

from __future__ import annotations

import torch
from common import median_seconds

import varuna_fx as vf
from varuna_fx.capture.inputs import bind_inputs
from varuna_fx.capture.trace import capture
from varuna_fx.examples import GPT, GPTConfig
from varuna_fx.passes import frontend


def measure(n_layer: int) -> tuple[float, float, float]:
    """(fresh compile, cached re-compile, capture alone) seconds for one GPT size."""
    model = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=n_layer, n_head=4, n_embd=128))
    tokens = torch.randint(0, 512, (8, 64))

    def compile_once(stages: int = 2) -> None:
        vf.compile(model, example_inputs=(tokens,), stages=stages, micro_batch_size=2)

    def fresh() -> None:
        frontend._CAPTURES.clear()
        compile_once()

    compile_once()  # warm the interpreter and the cache
    cold = median_seconds(fresh, 3)
    compile_once()
    cached = median_seconds(lambda: compile_once(stages=4), 3)
    only = median_seconds(lambda: capture(model, bind_inputs(model, (tokens,)), "auto"), 3)
    return cold, cached, only


def main() -> None:
    torch.manual_seed(0)
    print(f"{'layers':>6} {'fresh s':>8} {'cached s':>9} {'capture s':>10} {'saved':>6}")
    for n_layer in (4, 12, 24):
        cold, cached, only = measure(n_layer)
        print(f"{n_layer:>6} {cold:>8.3f} {cached:>9.3f} {only:>10.3f} "
              f"{1 - cached / cold:>6.0%}")


if __name__ == "__main__":
    main()
