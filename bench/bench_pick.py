"""compile's pick against the rows its plan lists, over links, memories and GPU counts.

Run: ``python bench/bench_pick.py`` (``--links``, ``--memories``, ``--gpus``). The model is
issue 23's: a 12-layer GPT (vocabulary 2048, width 256, block 64) on the meta device (planning
only), global batch 512, single-GPU machines. Per setting it prints the plan's predicted step
(the pick), the fastest row of ``plan.alternatives`` (per sample), the chosen row's schedule
and all-reduce, and "BAD" where the pick is slower than a listed row. No timing: exact.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import varuna_fx as vf  # noqa: E402
from varuna_fx.examples import GPT, GPTConfig, lm_loss  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", default="0.1Gbit/s,1Gbit/s,10Gbit/s,1000Gbit/s")
    parser.add_argument("--memories", default="128MiB,256MiB,1GiB")
    parser.add_argument("--gpus", default="8,32")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # (the meta device: plans only, and says so)
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=2048, n_embd=256, n_layer=12, n_head=4,
                              block_size=64))
    tokens = torch.zeros(8, 64, dtype=torch.long, device="meta")
    bad = 0
    for link, memory, gpus in itertools.product(args.links.split(","),
                                                args.memories.split(","),
                                                [int(g) for g in args.gpus.split(",")]):
        cluster = vf.Cluster(gpus=gpus, gpus_per_node=1, gpu_memory=memory,
                             inter_node_bandwidth=link, device="cuda")
        start = time.perf_counter()
        plan = vf.compile(model, cluster, example_inputs=(tokens,), loss_fn=lm_loss,
                          global_batch_size=512).plan
        assert plan.predicted_step_time is not None
        chosen = next(a for a in plan.alternatives if a.chosen)
        per_sample = plan.predicted_step_time / chosen.samples
        best = min(plan.alternatives, key=lambda a: a.step_time / a.samples)
        worse = per_sample > best.step_time / best.samples * (1 + 1e-9)
        bad += worse
        print(f"{link:>10} {memory:>7} {gpus:3d} {'BAD' if worse else 'ok '} "
              f"P={plan.stages} D={plan.data_parallel} b={plan.micro_batch_size} pick "
              f"{plan.predicted_step_time * 1e3:.2f} ms, best listed {best.step_time * 1e3:.2f}"
              f" ms, schedule {chosen.schedule or '-'}, all-reduce "
              f"{chosen.allreduce_time * 1e3:.2f} ms ({time.perf_counter() - start:.1f} s)",
              flush=True)
    print(f"{bad} settings picked slower than a listed row")


if __name__ == "__main__":
    from results import recorded

    with recorded("bench_pick.py"):
        main()
