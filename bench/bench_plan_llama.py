"""Planning a 7B- and a 70B-parameter Llama (issue 24 item 7b): seconds and peak RSS.

Run: ``python bench/bench_plan_llama.py`` (``--configs 7b,70b``, ``--layers N`` to override the
layer count, ``--profile PATH`` for a cProfile of the child's compile). Each config is planned
in a fresh child process (its peak RSS is the process's ``ru_maxrss``): transformers'
``LlamaConfig`` (``use_cache=False``), the model built under ``torch.device("meta")``, then
``vf.compile`` for 64 A100-class GPUs (8 per node, 80 GiB, 100 Gbit/s between nodes), global
batch 512 x sequence 2048, bf16. A meta model only plans (no rank holds weights), so the time
is capture + annotation + the planner's search. "seconds" is build + compile (wall); the
compile's CPU seconds (``time.process_time``) are steadier on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

CONFIGS = {  # the published shapes (vocabulary 32000)
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8),
}
SEQ, GLOBAL_BATCH = 2048, 512


def child(name: str, layers: int | None, profile: str | None) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import varuna_fx as vf

    shape = dict(CONFIGS[name])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    cfg = LlamaConfig(**shape, vocab_size=32000, max_position_embeddings=SEQ, use_cache=False)
    start = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    built = time.perf_counter() - start
    cluster = vf.Cluster(gpus=64, gpus_per_node=8, gpu_memory="80GiB",
                         inter_node_bandwidth="100Gbit/s", device_type="a100")
    tokens = torch.zeros(2, SEQ, dtype=torch.long)  # 1 would fix the batch for export

    def compile_() -> vf.Pipeline:
        return vf.compile(model, cluster=cluster, example_inputs={"input_ids": tokens,
                                                                  "labels": tokens},
                          global_batch_size=GLOBAL_BATCH, precision="bf16")

    start, cpu = time.perf_counter(), time.process_time()
    if profile:
        import cProfile
        profiler = cProfile.Profile()
        pipe = profiler.runcall(compile_)
        profiler.dump_stats(profile)
    else:
        pipe = compile_()
    compiled = time.perf_counter() - start
    cpu = time.process_time() - cpu
    plan = pipe.plan
    return {"config": name, "params": sum(p.numel() for p in model.parameters()),
            "layers": shape["num_hidden_layers"], "build": built, "compile": compiled, "cpu": cpu,
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "plan": f"P={plan.stages} D={plan.data_parallel} m={plan.micro_batch_size}"
                    f"x{plan.num_micro_batches} {plan.schedule.name} "
                    f"{plan.predicted_step_time:.3f} s/step"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", default="7b,70b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.profile)))
        return
    print("| config | params | layers | seconds (build + compile) | compile CPU s | peak RSS "
          "| plan |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.configs.split(","):
        cmd = [sys.executable, __file__, "--child", name]
        if args.layers is not None:
            cmd += ["--layers", str(args.layers)]
        if args.profile:
            cmd += ["--profile", f"{args.profile}.{name}"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"| {r['config']} | {r['params'] / 1e9:.2f} B | {r['layers']} | "
              f"{r['build'] + r['compile']:.1f} ({r['build']:.1f} + {r['compile']:.1f}) | "
              f"{r['cpu']:.1f} | "
              f"{r['rss'] / 2**20:.0f} MiB | {r['plan']} |", flush=True)


if __name__ == "__main__":
    main()
