"""Compiled stages against eager stages, side by side in one run (issue 43 item 6).

Run: ``OMP_NUM_THREADS=1 python bench/bench_compiled_stages.py [--layers 4] [--repeats 15]
[--quick] [--write]``. Three models, training mode, micro-batches of 2:

* the GPT of the train command (``varuna_fx.examples.GPT`` as ``demo_gpt`` builds it: d=64,
  8 x 64 tokens, ``--layers`` blocks), a Hugging Face ``LlamaForCausalLM`` built locally from a
  tiny ``LlamaConfig`` (``--layers`` layers, d=64, GQA 4/2 heads, 8 x 64 tokens; never
  downloaded) and an MLP (``--layers`` Linear(256, 256) + ReLU, a batch of 32);
* step time of ``compile_stages="off"`` against ``"on"`` in one process at P=1 (``1f1b``) and
  every schedule family at P=2 (``gpipe``, ``1f1b``, ``varuna``, ``1f1b-zb``: a split backward,
  ``interleaved-1f1b`` and ``zbv``: 2 ranks' worth of stages, 2 per rank), in interleaved
  rounds (rotating order). CPU time (``time.process_time``, one thread): the machine is shared,
  wall time would measure the neighbours. A ratio is the median over rounds of the round's
  eager/compiled ratio. One process runs every stage in turn, so a step is the stages' summed
  work (the schedule's bubble is not in it);
* against ``torch.distributed.pipelining`` (2 ranks under torchrun, gloo, ``Schedule1F1B``,
  stages split at the middle block, ``stage.submod`` through ``torch.compile`` against eager),
  with varuna_fx's ``1f1b`` at P=2 on the same 2 ranks, eager and compiled: wall time per step
  (two processes work at once: CPU time of one would miss the other), medians of round-robin
  steps; and the planner's prediction for the GPT's compiled P=2 plan (``profile=True``: the
  compiled stages priced by the measured compiled speed, planner/compiled_speed.py) against the
  measured compiled step;
* compile time: the first compiled step minus an eager step, with inductor's caches cold
  (a fresh ``TORCHINDUCTOR_CACHE_DIR``), and the same in a new process on that cache (what a
  restarted or joining process pays; wall seconds, the child's whole first step).

``--quick``: 2 layers, 4 rounds, the pipelining peer and the prediction on the GPT only: a
check that the script runs (its figures are noisy).

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

# (row name, stages, schedule, stages per rank): P=1, then every schedule family at P=2 (the
# virtual ones: 2 ranks of 2 stages)
CASES = (("P=1", 1, "1f1b", 1), ("P=2 gpipe", 2, "gpipe", 1), ("P=2 1f1b", 2, "1f1b", 1),
         ("P=2 varuna", 2, "varuna", 1), ("P=2 1f1b-zb", 2, "1f1b-zb", 1),
         ("P=2 interleaved-1f1b (2x2)", 4, "interleaved-1f1b", 2), ("P=2 zbv (2x2)", 4, "zbv", 2))
Case = tuple[Any, torch.Tensor, torch.Tensor, Any]  # model, input, target, loss_fn


def gpt_case(layers: int) -> Case:
    """The train command's GPT (``varuna_fx.examples.GPT``), as demo_gpt sizes it."""
    from varuna_fx.examples import demo_gpt, lm_loss

    model, x, y = demo_gpt(n_layer=layers)
    return model, x, y, lm_loss


def llama_case(layers: int) -> Case:
    """A Hugging Face Llama from a tiny config, built here (models are never downloaded)."""
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, attn_implementation="sdpa", use_cache=False)
    model = LlamaForCausalLM(cfg)
    model.train()
    tokens = torch.randint(0, 512, (8, 65))

    def loss(out: Any, y: torch.Tensor) -> torch.Tensor:
        # varuna_fx hands the model's output (a CausalLMOutput); pipelining's traced last stage
        # its flattened outputs (the logits first)
        logits = out.logits if hasattr(out, "logits") else \
            out[0] if isinstance(out, (tuple, list)) else out
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())
    return model, tokens[:, :-1], tokens[:, 1:], loss


def mlp_case(layers: int) -> Case:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(256, 10))

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out, y)
    return model, torch.randn(32, 256), torch.randint(0, 10, (32,)), loss


MODELS = {"GPT (train command's)": gpt_case, "HF Llama (tiny config)": llama_case,
          "MLP": mlp_case}


def build(layers: int, stages: int, schedule: str, compiled: bool, model_name: str = "",
          per_rank: int = 1, wait: bool = True) -> tuple[Any, Any, Any]:
    """``wait``: the first step compiles (compile_wait=True), so the steps after it are the
    compiled ones; False: compiled in the background (the default of compile_stages="on")."""
    import varuna_fx as vf

    model, x, y, loss = MODELS[model_name or next(iter(MODELS))](layers)
    micro = 2 if x.shape[0] <= 8 else 8
    pipe = vf.compile(model, vf.Cluster(gpus=stages // per_rank, device="cpu"),
                      example_inputs=(x,), loss_fn=loss, stages=stages, schedule=schedule,
                      micro_batch_size=micro, recompute=False, stages_per_rank=per_rank,
                      compile_stages="on" if compiled else "off", compile_wait=wait)
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


SPLITS = {"GPT (train command's)": lambda n: f"h.{n // 2}",
          "HF Llama (tiny config)": lambda n: f"model.layers.{n // 2}",
          "MLP": lambda n: str(2 * (n // 2))}


def one_process(layers: int, repeats: int, models: list[str]
                ) -> dict[tuple[str, str, bool], list[float]]:
    """CPU seconds per step of every (model, case, compiled) in one process, interleaved."""
    pipes: dict[tuple[str, str, bool], tuple[Any, Any, Any]] = {}
    for model in models:
        for name, stages, schedule, per_rank in CASES:
            for compiled in (False, True):
                pipes[(model, name, compiled)] = build(layers, stages, schedule, compiled,
                                                       model, per_rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for pipe, x, y in pipes.values():  # warm-up (the compiled ones compile here)
            for _ in range(2):
                step_seconds(pipe, x, y, time.process_time)
    times: dict[tuple[str, str, bool], list[float]] = {k: [] for k in pipes}
    keys = list(pipes)
    for r in range(repeats):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            pipe, x, y = pipes[k]
            times[k].append(step_seconds(pipe, x, y, time.process_time))
    return times


def ratio(e: list[float], c: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(e, c))


def distributed_worker(layers: int, quick: bool) -> None:
    """Under torchrun (2 ranks): varuna_fx's 1f1b at P=2, eager and compiled, and pipelining's
    Schedule1F1B with eager and torch.compile'd stage modules, round-robin, wall time per
    step; the planner's prediction for the GPT's plans (profile=True). Rank 0 prints JSON."""
    import copy

    import torch.distributed as dist

    import varuna_fx as vf

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for model_name in list(MODELS)[:1] if quick else MODELS:
        model, x, y, loss = MODELS[model_name](layers)
        micro = 2 if x.shape[0] <= 8 else 8
        steps: dict[str, Any] = {}
        for compiled in (False, True):
            pipe = vf.compile(copy.deepcopy(model), example_inputs=(x,), loss_fn=loss,
                              stages=2, schedule="1f1b", micro_batch_size=micro,
                              recompute=False, profile=model_name.startswith("GPT"),
                              compile_stages="on" if compiled else "off", compile_wait=True)
            label = f"varuna_fx 1f1b {'compiled' if compiled else 'eager'}"
            out[f"{model_name}|{label}|predicted"] = pipe.plan.predicted_step_time
            out[f"{model_name}|{label}|note"] = pipe.plan.compile_note

            def ours(pipe: Any = pipe, x: Any = x, y: Any = y) -> None:
                pipe.zero_grad()
                pipe.step(x, target=y)
            steps[label] = ours
            try:
                steps[f"pipelining Schedule1F1B {'compiled' if compiled else 'eager'}"] = \
                    pipelining_step(copy.deepcopy(model), x, y, loss, micro,
                                    SPLITS[model_name](layers), compiled)
            except Exception as exc:  # noqa: BLE001 - "where it can": say why not
                out[f"{model_name}|pipelining|error"] = f"{type(exc).__name__}: {exc}"[:200]
        times: dict[str, list[float]] = {k: [] for k in steps}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for it in range(2 + (4 if quick else 12)):
                for label, step in steps.items():
                    dist.barrier()
                    began = time.perf_counter()
                    step()
                    dist.barrier()
                    if it >= 2:  # the first two compile and warm
                        times[label].append(time.perf_counter() - began)
        for label, t in times.items():
            out[f"{model_name}|{label}|step"] = statistics.median(t)
    if rank == 0:
        print(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def pipelining_step(model: Any, x: torch.Tensor, y: torch.Tensor, loss: Any, micro: int,
                    split: str, compiled: bool) -> Any:
    """One step of torch.distributed.pipelining's Schedule1F1B on this rank's stage, its
    module through torch.compile where ``compiled``."""
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    pipe = pipeline(model, mb_args=(x[:micro],), split_spec={split: SplitPoint.BEGINNING})
    rank = dist.get_rank()
    stage = pipe.build_stage(rank, torch.device("cpu"))
    if compiled:
        stage.submod = torch.compile(stage.submod, dynamic=False)
    sched = Schedule1F1B(stage, n_microbatches=x.shape[0] // micro, loss_fn=loss)
    params = list(stage.submod.parameters())

    def step() -> None:
        for q in params:
            q.grad = None
        if rank == 0:
            sched.step(x, return_outputs=False)
        else:
            sched.step(target=y, losses=[], return_outputs=False)
    return step


def distributed(layers: int, cache: str, quick: bool) -> dict[str, Any]:
    """``distributed_worker`` on 2 local ranks (torchrun), on this run's caches."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, PYTHONPATH=str(SRC),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", __file__, "--distributed", "--layers", str(layers), *(["--quick"] * quick)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in done.stdout.strip().splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    return json.loads(lines[-1])


def distributed_rows(found: dict[str, Any]) -> list[str]:
    if "error" in found:
        return [f"- under torchrun: failed ({found['error']})"]
    rows = ["| model | system / stages | step (wall, median) | predicted | vs eager |",
            "| --- | --- | ---: | ---: | ---: |"]
    for model in MODELS:
        for system in ("varuna_fx 1f1b", "pipelining Schedule1F1B"):
            eager = found.get(f"{model}|{system} eager|step")
            for kind in ("eager", "compiled"):
                t = found.get(f"{model}|{system} {kind}|step")
                if t is None:
                    continue
                pred = found.get(f"{model}|{system} {kind}|predicted")
                shown = f"{pred * 1e3:.1f} ms ({pred / t:.2f}x measured)" if pred else "-"
                rows.append(f"| {model} | {system} {kind} | {t * 1e3:.1f} ms | {shown} | "
                            f"{eager / t:.3f}x |")
        if f"{model}|pipelining|error" in found:
            rows.append(f"| {model} | pipelining | n/a: {found[f'{model}|pipelining|error']} "
                        "| | |")
    return rows


def warm_profile(layers: int) -> str:
    """The GPT's profile and compiled speed measured once here (profile=True, cached), so the
    ranks under torchrun plan from the cache instead of both measuring; the plan's note."""
    import varuna_fx as vf

    model, x, _, loss = gpt_case(layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = vf.compile(model, vf.Cluster(gpus=2, device="cpu"), example_inputs=(x,),
                          loss_fn=loss, stages=2, schedule="1f1b", micro_batch_size=2,
                          recompute=False, profile=True, compile_stages="on",
                          compile_wait=True)
    return pipe.plan.compile_note


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="2 layers, 4 rounds: does it run")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--distributed", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--restart", action="store_true",
                    help="only the first step after a restart: background compile vs waiting")
    ap.add_argument("--restart-child", choices=("wait", "bg"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.layers, args.repeats = 2, 4
    torch.set_num_threads(1)
    if args.child:
        print(json.dumps(first_step(args.layers, child=True)))
        return
    if args.distributed:
        distributed_worker(args.layers, args.quick)
        return
    if args.restart_child:
        print(json.dumps(restart(args.layers, args.restart_child == "wait")))
        return
    if args.restart:
        restarts(args.layers)
        return
    cache = tempfile.mkdtemp(prefix="vf_inductor_bench_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # cold: nothing compiled there yet
    # this run's varuna_fx caches (profiles, the compiled speed): measured here, not found
    os.environ["VARUNA_FX_CACHE_DIR"] = tempfile.mkdtemp(prefix="vf_cache_bench_")

    # compile cold: the first compiled P=2 step in this process, fresh cache
    cold = first_step(args.layers)
    times = one_process(args.layers, args.repeats, list(MODELS))
    warm = child_first_step(args.layers, cache)
    # inductor's pool of compile workers starts on the first compile: one thread skips it
    warm_one = child_first_step(args.layers, cache, TORCHINDUCTOR_COMPILE_THREADS="1")
    here = warm_profile(args.layers)
    peer = distributed(args.layers, cache, args.quick)

    gpt = next(iter(MODELS))
    rows = ["| model | case | eager stages | compiled stages | eager / compiled (median of "
            "rounds) | fastest / fastest |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for model in MODELS:
        for name, _, _, _ in CASES:
            e, c = times[(model, name, False)], times[(model, name, True)]
            rows.append(f"| {model} | {name} | {statistics.median(e) * 1e3:.1f} ms | "
                        f"{statistics.median(c) * 1e3:.1f} ms | {ratio(e, c):.3f}x | "
                        f"{min(e) / min(c):.3f}x |")
    zb_eager = statistics.median(times[(gpt, "P=2 1f1b-zb", False)])
    zb_compiled = statistics.median(times[(gpt, "P=2 1f1b-zb", True)])
    p2 = ratio(times[(gpt, "P=2 1f1b", False)], times[(gpt, "P=2 1f1b", True)])
    cold_s = cold["first"] - cold["eager"]
    warm_s = warm["first"] - warm["eager"]
    warm_one_s = warm_one["first"] - warm_one["eager"]
    predicted = peer.get(f"{gpt}|varuna_fx 1f1b compiled|predicted")
    measured = peer.get(f"{gpt}|varuna_fx 1f1b compiled|step")
    text = "\n".join([
        f"`OMP_NUM_THREADS=1 python bench/bench_compiled_stages.py --layers {args.layers} "
        f"--repeats {args.repeats}{' --quick' if args.quick else ''}` (torch "
        f"{torch.__version__}, CPU, one thread; CPU time per step, medians over interleaved "
        "rounds; the machine is shared by other agents)", "",
        f"{args.layers} layers each: the train command's GPT (d=64, 8 x 64 tokens), a Hugging "
        "Face Llama from a tiny config (d=64, GQA 4/2, 8 x 64 tokens), an MLP (256 wide, "
        "batch 32); micro-batches of 2 (MLP: 8); one process runs every stage", "",
        *rows, "",
        "Under torchrun, 2 ranks (gloo, one thread each; wall time per step, medians of "
        "round-robin steps; predicted: the plan's step, profile=True, compiled stages priced "
        "by the measured compiled speed):", "",
        *distributed_rows(peer), "",
        f"- compile (P=2, both stages, forward + backward; wall): cold {cold_s:.1f} s (first "
        f"compiled step {cold['first']:.1f} s, inductor's imports included); from the cache in "
        f"a new process {warm_s:.1f} s after {warm['imports']:.1f} s importing inductor, "
        f"{warm_one_s:.1f} s with TORCHINDUCTOR_COMPILE_THREADS=1 (no compile-worker pool "
        f"to start; imports {warm_one['imports']:.1f} s)",
        "- the GPT's compiled P=2 plan: predicted "
        + (f"{predicted * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms "
           f"({predicted / measured:.2f}x)" if predicted and measured else "n/a")
        + f"; its note: {peer.get(f'{gpt}|varuna_fx 1f1b compiled|note', '-')} (the same "
        f"plan in one process, before: {here})",
        f"- target P=2 >= 1.08x on the GPT: {'met' if p2 >= 1.08 else 'missed'} ({p2:.3f}x); "
        "compiled zero-bubble faster than eager zero-bubble: "
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
