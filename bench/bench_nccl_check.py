"""What proving the NCCL order costs: lowering a schedule and checking it (static, the run-time
rule with every gradient late, one random interleaving: what the distributed runtime does once
per order before the first step), over P and m.

    python bench/bench_nccl_check.py              # varuna, P in 2 4 8 16, m in 8 32 64
"""

from __future__ import annotations

import argparse
import statistics
import time

from varuna_fx.schedule import build_schedule, check_comms, lower_schedule


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", default="varuna")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("| P | m | ops | lower ms | static check ms | rule checks (late + random) ms |")
    print("| - | - | - | - | - | - |")
    for p in args.stages:
        for m in args.micro_batches:
            sched = build_schedule(args.schedule, p, m, True)
            low, static, rule = [], [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                lowered = lower_schedule(sched, replicas=2)
                t1 = time.perf_counter()
                check_comms(lowered)
                t2 = time.perf_counter()
                check_comms(lowered, reorder=True, late=True)
                check_comms(lowered, reorder=True, seed=0)
                t3 = time.perf_counter()
                low.append(t1 - t0)
                static.append(t2 - t1)
                rule.append(t3 - t2)
            ops = sum(len(prog.ops) for prog in lowered.programs)
            print(f"| {p} | {m} | {ops} | {statistics.median(low) * 1e3:.1f} | "
                  f"{statistics.median(static) * 1e3:.1f} | {statistics.median(rule) * 1e3:.1f} |")


if __name__ == "__main__":
    from results import recorded

    with recorded("bench_nccl_check.py"):
        main()
