"""Partition balance of vf.compile vs an equal-layer split and a parameter-count split.

Run: ``python bench/bench_balance.py``. Model: the shipped GPT (tied embedding / LM head) with
48 layers, d=1024, a 50257-token vocabulary, sequence 1024, micro-batch 1, on meta parameters.
Every split is evaluated on the SAME cost arrays (``partition_problem``: forward + recompute +
backward per node, plus the send time of what crosses the stage's right edge):

* ours: ``pipe.plan.stage_costs[s].time`` (checked equal to the arrays at our cuts);
* equal-layer (torch.distributed.pipelining's split_spec style): n_layer/P blocks per stage,
  embeddings with the first stage, ln_f + LM head with the last;
* parameter-count (DeepSpeed ``partition_method="parameters"``): layers cut so that the largest
  stage parameter count is smallest, the tied LM head counted again on the last layer as
  DeepSpeed's TiedLayerSpec does.

``bneck x``: the split's largest stage time over ours (steady-state throughput loss).
Columns marked † use schedule-accurate costs, where the last stage does no recompute (every
schedule's convention): ours evaluated that way, and the optimum of that objective found by an
independent unreduced O(P N^2) dynamic program (which also asserts that ours is optimal for
the partitioner's own objective).
"""

from __future__ import annotations

import re

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

import varuna_fx as vf
from varuna_fx.costs.roofline import device_spec, step_time
from varuna_fx.examples import GPT, GPTConfig
from varuna_fx.ir.nodes import info
from varuna_fx.passes.assign_stages import CostSetting, compute_nodes, partition_problem
from varuna_fx.passes.partition import PartitionProblem, partition
from varuna_fx.schedule import build_schedule, peak_stash_counts

CFG = GPTConfig(n_layer=48, n_embd=1024, n_head=16, vocab_size=50257, block_size=1024)
MB = 1
CLUSTERS = {
    "8/node 100GB/s": dict(gpus_per_node=8),
    "1/node 10Gbit/s": dict(gpus_per_node=1),
}


def unit_of_nodes(nodes: list) -> np.ndarray:
    """Layer unit of each compute node: 0 embeddings, 1..L blocks, L+1 ln_f + head."""
    units, seen_block = [], False
    for node in nodes:
        match = re.match(r"h\.(\d+)(\.|$)", info(node).module_path)
        if match:
            seen_block = True
            units.append(1 + int(match.group(1)))
        else:
            units.append(CFG.n_layer + 1 if seen_block else 0)
    units_arr = np.array(units)
    assert (np.diff(units_arr) >= 0).all(), "layers are not contiguous in graph order"
    return units_arr


def unit_params(model: GPT) -> np.ndarray:
    def count(*mods: torch.nn.Module) -> int:
        return sum(p.numel() for m in mods for p in m.parameters())

    blocks = [count(b) for b in model.h]
    return np.array([count(model.wte, model.wpe), *blocks, count(model.ln_f, model.lm_head)],
                    dtype=float)


def bounds_from_units(units: np.ndarray, first_units: list[int]) -> list[int]:
    """Node cut positions where each stage's first layer unit begins."""
    return [0, *(int(np.argmax(units >= u)) for u in first_units[1:]), len(units)]


def times(compute: np.ndarray, last: np.ndarray, send: np.ndarray, bounds: list[int]) -> list:
    out = [compute[a:b].sum() + send[b] for a, b in zip(bounds[:-2], bounds[1:-1])]
    return [*out, last[bounds[-2]:].sum()]


def ratio(t: list[float]) -> float:
    return max(t) / (sum(t) / len(t))


def optimum(compute: np.ndarray, last: np.ndarray, send: np.ndarray, p: int) -> list[float]:
    """Unreduced min-max DP (first P-1 stages use ``compute``, the last ``last``)."""
    n = len(compute)
    c = np.concatenate([[0.0], np.cumsum(compute)])
    cl = np.concatenate([[0.0], np.cumsum(last)])
    idx = np.arange(n + 1)
    ok = np.isfinite(send)
    cost = np.where((idx[:, None] < idx[None, :]) & ok[:, None] & ok[None, :],
                    c[None, :] - c[:, None] + send[None, :], np.inf)
    best, parents = cost[0].copy(), []
    for _ in range(p - 2):
        cand = np.maximum(best[:, None], cost)
        parents.append(np.argmin(cand, axis=0))
        best = cand[parents[-1], idx]
    tail = np.where(ok & (idx < n), cl[n] - cl, np.inf)
    j = int(np.argmin(np.maximum(best, tail))) if p > 1 else 0
    bounds = [n, j]
    for par in reversed(parents):
        bounds.append(int(par[bounds[-1]]))
    bounds = ([0] if p > 1 else []) + bounds[::-1]
    return times(compute, last, send, bounds)


def main() -> None:
    with torch.device("meta"):
        model = GPT(CFG)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.block_size))
    params = unit_params(model)
    table = Table(title="Stage balance max/mean, GPT 48 x 1024, vocab 50257 (tied head), "
                        "seq 1024, micro-batch 1, V100-class cost model")
    for col in ["tracer", "cluster", "P", "ours", "equal-layer", "param-count", "eq bneck x",
                "param bneck x"]:
        table.add_column(col, justify="right")
    for tracer in ("fx", "export"):
        for cname, kw in CLUSTERS.items():
            for p in (2, 4, 8):
                cluster = vf.Cluster(gpus=p, gpu_memory="80GiB", **kw)
                pipe = vf.compile(model, cluster, (tokens,), stages=p, micro_batch_size=MB,
                                  tracer=tracer)
                gm = pipe.captured.gm
                m = pipe.plan.num_micro_batches
                in_flight = max(peak_stash_counts(build_schedule("varuna", p, m)))
                bandwidth = cluster.intra_node_bandwidth if cluster.gpus_per_node > 1 else \
                    cluster.inter_node_bandwidth  # a replica's neighbouring stages
                setting = CostSetting(MB, device_spec(cluster.device), bandwidth,
                                      cluster.gpu_memory, in_flight, True)
                costs: PartitionProblem = partition_problem(gm, setting)
                nodes = compute_nodes(gm)
                send = costs.cut_bytes / setting.bandwidth
                send[-1] = 0.0
                no_rc = np.array([step_time(info(x), MB, setting.device, False) for x in nodes])
                stage = np.array([info(x).stage for x in nodes])
                ours_b = [0, *(int(np.argmax(stage >= s)) for s in range(1, p)), len(nodes)]
                ours = [s.time for s in pipe.plan.stage_costs]
                # the last stage never recomputes; the partition pass prices it that way
                assert np.allclose(times(costs.compute, no_rc, send, ours_b), ours)
                units = unit_of_nodes(nodes)
                per = CFG.n_layer // p
                eq_b = bounds_from_units(units, [0] + [1 + s * per for s in range(1, p)])
                unit_split = partition(PartitionProblem(params, np.zeros_like(params),
                                                      np.zeros_like(params),
                                                      np.zeros(len(params) + 1)), p)
                par_b = bounds_from_units(units, list(unit_split.bounds[:-1]))
                eq = times(costs.compute, no_rc, send, eq_b)
                par = times(costs.compute, no_rc, send, par_b)
                opt = optimum(costs.compute, no_rc, send, p)  # unreduced DP: ours must equal it
                assert np.isclose(max(opt), max(ours), rtol=1e-9), (max(opt), max(ours))
                table.add_row(tracer, cname, str(p), f"{ratio(ours):.3f}", f"{ratio(eq):.3f}",
                              f"{ratio(par):.3f}", f"{max(eq) / max(ours):.3f}",
                              f"{max(par) / max(ours):.3f}")
            table.add_section()
    Console(width=150).print(table)


if __name__ == "__main__":
    from results import recorded

    with recorded("bench_balance.py"):
        main()
