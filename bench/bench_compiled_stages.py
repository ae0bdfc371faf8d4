"""Compiled stages against eager stages, side by side in one process (issue 43 item 6).

Run: ``OMP_NUM_THREADS=1 python bench/bench_compiled_stages.py [--layers 4] [--repeats 15]
[--write]``. The GPT of ``varuna_fx.examples.demo_gpt`` (d=64, 8 x 64 tokens, ``--layers``
blocks), training mode, one process, micro-batches of 2 (4 per step):

* step time of ``compile_stages="off"`` against ``"on"`` at P=1 (``1f1b``), P=2 ``1f1b`` and
  P=2 ``1f1b-zb`` (a split backward), in interleaved rounds (rotating order). CPU time
  (``time.process_time``, one thread): the machine is shared, wall time would measure the
  neighbours. A ratio is the median over rounds of the round's eager/compiled ratio;
* compile time: the first compiled step minus an eager step, with inductor's caches cold
  (a fresh ``TORCHINDUCTOR_CACHE_DIR``), and the same in a new process on that cache (what a
  restarted or joining process pays; wall seconds, the child's whole first step).

``--restart`` measures only the first step after a restart (a new process, P=2): the compile
waited for (``compile_wait=True``) against in the background (the default), cold and warm.

Targets: compiled >= 1.08x eager at P=2 on the GPT, compiled zero-bubble faster than eager
zero-bubble, <= 3 s compile from the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
from common import SRC, write_block

CASES = (("P=1", 1, "1f1b"), ("P=2 1f1b", 2, "1f1b"), ("P=2 1f1b-zb", 2, "1f1b-zb"))


def build(layers: int, stages: int, schedule: str, compiled: bool,
          wait: bool = True) -> tuple[Any, Any, Any]:
    """``wait``: the first step compiles (compile_wait=True), so the steps after it are the
    compiled ones; False: compiled in the background (the default of compile_stages="on")."""
    import varuna_fx as vf
    from varuna_fx.examples import demo_gpt, lm_loss

    model, x, y = demo_gpt(n_layer=layers)
    pipe = vf.compile(model, vf.Cluster(gpus=stages, device="cpu"), example_inputs=(x,),
                      loss_fn=lm_loss, stages=stages, schedule=schedule, micro_batch_size=2,
                      recompute=False, compile_stages="on" if compiled else "off",
                      compile_wait=wait)
    return pipe, x, y


def step_seconds(pipe: Any, x: torch.Tensor, y: torch.Tensor, clock: Any) -> float:
    start = clock()
    pipe.zero_grad()
    pipe.step(x, target=y)
    return clock() - start


def first_step(layers: int, child: bool = False) -> dict[str, float]:
    """A new process's first compiled step at P=2 (its cache dir set by the parent), and an
    eager step of the same pipeline shape for the difference; in a child, inductor's modules
    are imported first, timed on their own."""
    began = time.perf_counter()
    if child:
        import torch._inductor.compile_fx  # noqa: F401 - what the first compile imports
    imports = time.perf_counter() - began
    eager, x, y = build(layers, 2, "1f1b", False)
    for _ in range(2):
        step_seconds(eager, x, y, time.perf_counter)
    eager_s = min(step_seconds(eager, x, y, time.perf_counter) for _ in range(3))
    pipe, x, y = build(layers, 2, "1f1b", True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = step_seconds(pipe, x, y, time.perf_counter)
    return {"first": first, "eager": eager_s, "imports": imports}


def child_first_step(layers: int, cache: str, **more: str) -> dict[str, float]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, PYTHONPATH=str(SRC), **more)
    out = subprocess.run([sys.executable, __file__, "--child", "--layers", str(layers)],
                         env=env, capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def restart(layers: int, wait: bool, limit: float = 400.0) -> dict[str, Any]:
    """A restarted process's steps at P=2 (wall seconds): its first step, with the compile
    waited for or in the background; then steps until every stage runs compiled (background:
    when the switch came, and the eager steps meanwhile), and a few compiled steps."""
    pipe, x, y = build(layers, 2, "1f1b", True, wait=wait)
    calls = [w.call for w in pipe.runtime.workers]
    began = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = step_seconds(pipe, x, y, time.perf_counter)
        during: list[float] = []
        while not all(getattr(c, "compiled", True) is not None for c in calls) and \
                time.perf_counter() - began < limit:
            during.append(step_seconds(pipe, x, y, time.perf_counter))
        switched = time.perf_counter() - began
        after = [step_seconds(pipe, x, y, time.perf_counter) for _ in range(5)]
    return {"first": first, "during": during, "switched": switched,
            "after": statistics.median(after),
            "compile": [getattr(c, "compile_seconds", None) for c in calls]}


def child_restart(layers: int, cache: str, wait: bool) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, PYTHONPATH=str(SRC))
    out = subprocess.run([sys.executable, __file__, "--restart-child", "wait" if wait else "bg",
                          "--layers", str(layers)],
                         env=env, capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def restarts(layers: int) -> None:
    """``--restart``: the first step after a restart, the compile waited for against in the
    background, each in a new process, on a cold inductor cache and then on the warm one."""
    print(f"| demo GPT {layers} layers, P=2 1f1b, new process | first step | eager steps "
          "while compiling | switched after | compiled step | background compile |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    # each mode its own cache: cold at first, then as its cold run left it
    caches = {w: tempfile.mkdtemp(prefix="vf_inductor_restart_") for w in (True, False)}
    for cache_state in ("cold", "warm"):
        for wait in (True, False):
            r = child_restart(layers, caches[wait], wait)
            during = (f"{len(r['during'])} x {statistics.median(r['during']) * 1e3:.0f} ms"
                      if r["during"] else "-")
            comp = ", ".join(f"{c:.1f} s" for c in r["compile"] if c is not None) or "-"
            print(f"| {cache_state}, {'compile_wait=True' if wait else 'background'} | "
                  f"{r['first']:.2f} s | {during} | {r['switched']:.1f} s | "
                  f"{r['after'] * 1e3:.0f} ms | {comp} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--restart", action="store_true",
                    help="only the first step after a restart: background compile vs waiting")
    ap.add_argument("--restart-child", choices=("wait", "bg"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.child:
        print(json.dumps(first_step(args.layers, child=True)))
        return
    if args.restart_child:
        print(json.dumps(restart(args.layers, args.restart_child == "wait")))
        return
    if args.restart:
        restarts(args.layers)
        return
    cache = tempfile.mkdtemp(prefix="vf_inductor_bench_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # cold: nothing compiled there yet

    # compile cold: the first compiled P=2 step in this process, fresh cache
    cold = first_step(args.layers)
    pipes: dict[tuple[str, bool], tuple[Any, Any, Any]] = {}
    for name, stages, schedule in CASES:
        for compiled in (False, True):
            pipes[(name, compiled)] = build(args.layers, stages, schedule, compiled)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for pipe, x, y in pipes.values():  # warm-up (the compiled ones compile here)
            for _ in range(2):
                step_seconds(pipe, x, y, time.process_time)
    times: dict[tuple[str, bool], list[float]] = {k: [] for k in pipes}
    keys = list(pipes)
    for r in range(args.repeats):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            pipe, x, y = pipes[k]
            times[k].append(step_seconds(pipe, x, y, time.process_time))
    warm = child_first_step(args.layers, cache)
    # inductor's pool of compile workers starts on the first compile: one thread skips it
    warm_one = child_first_step(args.layers, cache, TORCHINDUCTOR_COMPILE_THREADS="1")

    rows = ["| case | eager stages | compiled stages | eager / compiled (median of rounds) "
            "| fastest / fastest |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, _, _ in CASES:
        e, c = times[(name, False)], times[(name, True)]
        ratio = statistics.median(a / b for a, b in zip(e, c))
        rows.append(f"| {name} | {statistics.median(e) * 1e3:.1f} ms | "
                    f"{statistics.median(c) * 1e3:.1f} ms | {ratio:.3f}x | "
                    f"{min(e) / min(c):.3f}x |")
    zb_eager = statistics.median(times[("P=2 1f1b-zb", False)])
    zb_compiled = statistics.median(times[("P=2 1f1b-zb", True)])
    p2 = statistics.median(a / b for a, b in zip(times[("P=2 1f1b", False)],
                                                times[("P=2 1f1b", True)]))
    cold_s = cold["first"] - cold["eager"]
    warm_s = warm["first"] - warm["eager"]
    warm_one_s = warm_one["first"] - warm_one["eager"]
    text = "\n".join([
        f"`OMP_NUM_THREADS=1 python bench/bench_compiled_stages.py --layers {args.layers} "
        f"--repeats {args.repeats}` (torch {torch.__version__}, CPU, one thread; CPU time per "
        "step, medians over interleaved rounds; the machine is shared by other agents)",
        "", f"demo GPT, {args.layers} layers, d=64, 8 x 64 tokens, micro-batch 2 x 4", "",
        *rows, "",
        f"- compile (P=2, both stages, forward + backward; wall): cold {cold_s:.1f} s (first "
        f"compiled step {cold['first']:.1f} s, inductor's imports included); from the cache in "
        f"a new process {warm_s:.1f} s after {warm['imports']:.1f} s importing inductor, "
        f"{warm_one_s:.1f} s with TORCHINDUCTOR_COMPILE_THREADS=1 (no compile-worker pool "
        f"to start; imports {warm_one['imports']:.1f} s)",
        f"- target P=2 >= 1.08x: {'met' if p2 >= 1.08 else 'missed'} ({p2:.3f}x); compiled "
        f"zero-bubble faster than eager zero-bubble: "
        f"{'met' if zb_compiled < zb_eager else 'missed'} ({zb_eager * 1e3:.1f} -> "
        f"{zb_compiled * 1e3:.1f} ms); <= 3 s from the cache: "
        f"{'met' if warm_s <= 3.0 else 'missed'} ({warm_s:.1f} s; {warm_one_s:.1f} s on one "
        "compile thread)",
    ])
    print(text)
    if args.write:
        write_block("bench_compiled_stages.py", text)


if __name__ == "__main__":
    main()
