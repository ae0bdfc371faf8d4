"""Planning a 7B- and a 70B-parameter Llama (issue 24 item 7b): seconds and peak RSS.

Run: ``python bench/bench_plan_llama.py`` (``--configs 7b,70b``, ``--layers N`` to override the
layer count, ``--profile PATH`` for a cProfile of the child's first compile, ``--worlds``
the GPU counts compiled one after another in the first child). Each config is planned in fresh
child processes (peak RSS is each process's ``ru_maxrss``): transformers' ``LlamaConfig``
(``use_cache=False``), the model built under ``torch.device("meta")``, then ``vf.compile`` for
64 A100-class GPUs (8 per node, 80 GiB, 100 Gbit/s between nodes), global batch 512 x sequence
2048, bf16. A meta model only plans (no rank holds weights), so the time is capture +
annotation + the planner's search + partition and code generation.

Issue 32 item 2 (re-plan in seconds), in a fresh cache directory (``$VARUNA_FX_CACHE_DIR``):
the first child compiles at each of ``--worlds`` (default 64, 64, 56): "cold" (nothing cached),
"again" (same world in the same process: the search's answer from the process's plan cache,
``planner/cache.py``), then 56 GPUs (a node lost: a new search, as ``Replan`` would run it; its
"re-plan" column leaves out capture and the annotation passes, which a re-plan on a graph
already captured does not run). A second child then compiles at 56 GPUs as a restarted process
would, with the files the first left (shape and plan caches). ``--preplan`` (with ``--running``) searches the last world in a forked child right after the
first compile, as an in-place job does after a step (``morph/preplan.py``), so the compile at
that world finds its search on disk. ``--running`` plans as a launched job does (an in-place morph's re-plan among them): ``P x D``
equal to the GPUs of the world, not at most as many. Every figure is CPU seconds
(``time.process_time``: a shared machine moves wall time far more), per pass from
``GraphState.seconds``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

CONFIGS = {  # the published shapes (vocabulary 32000)
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8),
}
SEQ, GLOBAL_BATCH = 2048, 512
OPTIONS = dict(global_batch_size=GLOBAL_BATCH, precision="bf16")


FRONT = ("capture", "annotate_shapes", "specialize_sizes", "annotate_backward",
         "mark_replicable", "mark_sample_mixing")


def child(name: str, layers: int | None, profile: str | None, worlds: list[int],
          running: bool = False, preplan: bool = False) -> list[dict]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import varuna_fx as vf
    from varuna_fx import api
    from varuna_fx.planner import cache as plan_cache
    from varuna_fx.world.where import assumed_world

    shape = dict(CONFIGS[name])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    cfg = LlamaConfig(**shape, vocab_size=32000, max_position_embeddings=SEQ, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    tokens = torch.zeros(2, SEQ, dtype=torch.long)  # 1 would fix the batch for export
    inputs = {"input_ids": tokens, "labels": tokens}
    seconds_of = []  # each compile's CPU seconds per pass (not its state: that holds graphs)
    real = api.run_after_front_end

    def keep(state, dump=None):  # noqa: ANN001, ANN202 - the pass list's own signature
        real(state, dump)
        seconds_of.append(dict(state.seconds))

    api.run_after_front_end = keep  # (to read each pass's CPU seconds off the compile's state)
    rows = []
    for k, gpus in enumerate(worlds):
        cluster = vf.Cluster(gpus=gpus, gpus_per_node=8, gpu_memory="80GiB",
                             inter_node_bandwidth="100Gbit/s", device_type="a100")

        def compile_(cluster: vf.Cluster = cluster) -> vf.Pipeline:
            # running: as in a launched job, P x D must be the world (the GPUs) exactly
            with assumed_world(cluster.gpus) if running else contextlib.nullcontext():
                return vf.compile(model, cluster=cluster, example_inputs=inputs, **OPTIONS)

        hits = plan_cache.stats["hit"]
        cpu = time.process_time()
        if profile and k == 0:
            import cProfile
            profiler = cProfile.Profile()
            pipe = profiler.runcall(compile_)
            profiler.dump_stats(profile)
        else:
            pipe = compile_()
        cpu = time.process_time() - cpu
        plan, seconds = pipe.plan, seconds_of[-1]
        rows.append({
            "config": name, "gpus": gpus, "params": sum(p.numel() for p in model.parameters()),
            "layers": shape["num_hidden_layers"], "cpu": cpu,
            "front": sum(v for p, v in seconds.items() if p in FRONT),
            "replan": sum(v for p, v in seconds.items() if p not in FRONT),
            "passes": seconds, "search_cached": plan_cache.stats["hit"] > hits,
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "plan": f"P={plan.stages} D={plan.data_parallel} m={plan.micro_batch_size}"
                    f"x{plan.num_micro_batches} {plan.schedule.name} "
                    f"{plan.predicted_step_time:.3f} s/step"})
        if preplan and k == 0:  # what an in-place job does after its first step
            rows[-1]["preplan"] = _preplan(model, inputs, pipe.captured, cluster, worlds[-1])
        del pipe  # (the next compile's peak RSS without this one's pipeline)
    return rows


def _preplan(model, inputs, captured, cluster, world: int) -> float:  # noqa: ANN001
    """Search ``world`` in a forked child (``morph/preplan.py``) as an in-place job does after
    a step, from the Replan compile makes (its captured graph); the child's wall seconds."""
    from varuna_fx import api
    from varuna_fx.capture.inputs import bind_inputs
    from varuna_fx.morph.preplan import Preplanner
    from varuna_fx.options import CompileOptions
    from varuna_fx.passes.annotate_backward import canonical_names

    o = CompileOptions(cluster=cluster, **OPTIONS)
    replan = api.Replan(model, bind_inputs(model, inputs), canonical_names(model), captured, o,
                        cluster)
    start = time.perf_counter()
    planner = Preplanner(replan)
    if planner.start(cluster, GLOBAL_BATCH, worlds=[world]) is None:
        return float("nan")
    planner.wait(3000)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", default="7b,70b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--worlds", default="64,64,56")
    parser.add_argument("--restart", default="56", help="GPUs of the restarted child ('': none)")
    parser.add_argument("--running", action="store_true",
                        help="plan as a launched job (an in-place morph's re-plan) does: P x D "
                             "equal to the GPUs, not at most")
    parser.add_argument("--preplan", action="store_true",
                        help="after the first compile, search the last world in a forked "
                             "child as an in-place job does (morph/preplan.py)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        worlds = [int(w) for w in args.worlds.split(",")]
        print(json.dumps(child(args.child, args.layers, args.profile, worlds, args.running,
                               args.preplan)))
        return
    print(f"load average {os.getloadavg()}")
    print("| config | params | layers | process | GPUs | compile CPU s | front end CPU s "
          "| re-plan CPU s (configure ... codegen) | search | peak RSS | plan |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.configs.split(","):
        env = {**os.environ, "VARUNA_FX_CACHE_DIR": tempfile.mkdtemp(prefix="bench_plan_")}
        runs = [("first", args.worlds, args.profile)]
        if args.restart:
            runs.append(("restarted", args.restart, None))
        for process, worlds, profile in runs:
            cmd = [sys.executable, __file__, "--child", name, "--worlds", worlds]
            if args.layers is not None:
                cmd += ["--layers", str(args.layers)]
            if args.running:
                cmd += ["--running"]
            if args.preplan and process == "first":
                cmd += ["--preplan"]
            if profile:
                cmd += ["--profile", f"{profile}.{name}"]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                                 env=env).stdout
            for r in json.loads(out.strip().splitlines()[-1]):
                passes = ", ".join(f"{p} {v:.1f}" for p, v in r["passes"].items() if v >= 0.05)
                print(f"| {r['config']} | {r['params'] / 1e9:.2f} B | {r['layers']} | "
                      f"{process} | {r['gpus']} | {r['cpu']:.1f} | {r['front']:.1f} | "
                      f"{r['replan']:.1f} | {'cached' if r['search_cached'] else 'searched'} | "
                      f"{r['rss'] / 2**20:.0f} MiB | {r['plan']} |", flush=True)
                print(f"<!-- {r['config']} {process} {r['gpus']}: {passes} -->", flush=True)
                if "preplan" in r:
                    print(f"<!-- pre-planned {worlds.split(',')[-1]} GPUs in a child: "
                          f"{r['preplan']:.1f} s wall -->", flush=True)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    from results import recorded

    with recorded("bench_plan_llama.py"):
        main()
