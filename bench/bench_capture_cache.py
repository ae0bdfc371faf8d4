"""What the capture caches save when compiling an unchanged model again (another P).

Run: ``python bench/bench_capture_cache.py``. Per GPT size, medians of 3: a compile with every
graph cache off ("fresh": ``VARUNA_FX_GRAPH_CACHE=0``, the process's captures forgotten); one
as a restarted process makes it ("restarted": the process's captures forgotten, the disk's
captured graph and shape observations found, ``capture/capture_cache.py``,
``passes/shape_cache.py``); a re-compile of the same model object in the process ("in
process": its key taken before tracing finds the captured and annotated graph); and capture
alone (what each compile paid before captures were keyed before tracing).
"""

from __future__ import annotations

import os
import tempfile

import torch
from common import median_seconds

import varuna_fx as vf
from varuna_fx.capture.inputs import bind_inputs
from varuna_fx.capture.trace import capture
from varuna_fx.examples import GPT, GPTConfig
from varuna_fx.passes import frontend


def measure(n_layer: int) -> tuple[float, float, float, float]:
    """(fresh, restarted, in process, capture alone) seconds for one GPT size."""
    model = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=n_layer, n_head=4, n_embd=128))
    tokens = torch.randint(0, 512, (8, 64))

    def compile_once(stages: int = 2) -> None:
        vf.compile(model, example_inputs=(tokens,), stages=stages, micro_batch_size=2)

    def forgotten() -> None:
        frontend._CAPTURES.clear()
        compile_once()

    compile_once()  # warm the interpreter and the disk caches
    os.environ["VARUNA_FX_GRAPH_CACHE"] = "0"
    cold = median_seconds(forgotten, 3)
    del os.environ["VARUNA_FX_GRAPH_CACHE"]
    restarted = median_seconds(forgotten, 3)
    compile_once()
    cached = median_seconds(lambda: compile_once(stages=4), 3)
    only = median_seconds(lambda: capture(model, bind_inputs(model, (tokens,)), "auto"), 3)
    return cold, restarted, cached, only


def main() -> None:
    torch.manual_seed(0)
    os.environ.setdefault("VARUNA_FX_CACHE_DIR", tempfile.mkdtemp(prefix="bench_capture_"))
    print("| layers | fresh | restarted | in process | capture alone |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n_layer in (4, 12, 24):
        cold, restarted, cached, only = measure(n_layer)
        print(f"| {n_layer} | {cold:.2f} s | {restarted:.2f} s ({1 - restarted / cold:.0%} "
              f"saved) | {cached:.2f} s ({1 - cached / cold:.0%} saved) | {only:.2f} s |")


if __name__ == "__main__":
    from results import recorded

    with recorded("bench_capture_cache.py"):
        main()
