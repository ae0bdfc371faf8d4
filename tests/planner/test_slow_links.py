"""Links the planner can see (issue 31 items 1-4), on described clusters: which links are slow,
the partition weighing each boundary by its link, "auto"'s choice per link, and the price of
every setting."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import varuna_fx as vf
from varuna_fx.costs.wire import wire_bytes
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.passes.partition import PartitionProblem, partition
from varuna_fx.planner import analyze, plan_for
from varuna_fx.planner.candidates import Candidate
from varuna_fx.planner.network import links
from varuna_fx.world.network import NetworkProfile

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)
X = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def graph() -> object:
    torch.manual_seed(0)
    return analyze(GPT(CFG), (X,))


def best(graph: object, cluster: vf.Cluster, **kw: object) -> Candidate:
    """The planner's choice (as compile's search makes it), at micro-batch size 2."""
    kw.setdefault("data_parallel", 1)
    return plan_for(graph, cluster, micro_batch_size=2, recompute=False,  # type: ignore[arg-type]
                    global_batch_size=8 * int(kw["data_parallel"]), **kw).best  # type: ignore[arg-type]


def two_speed(gpus: int, per_node: int) -> vf.Cluster:
    """Fast within a node, 100 Mbit/s between nodes."""
    return vf.Cluster(gpus=gpus, gpus_per_node=per_node, device="cpu",
                      intra_node_bandwidth="100GB/s", inter_node_bandwidth="100Mbit/s")


def plan(cluster: vf.Cluster, **kw: object) -> vf.Plan:
    torch.manual_seed(0)
    return vf.compile(GPT(CFG), cluster, example_inputs=(X,), loss_fn=lm_loss,
                      micro_batch_size=2, **kw).plan


def test_links_say_which_cross_nodes_stated_or_measured() -> None:
    net = links(two_speed(8, 2), 4, 2)
    assert net.slow == (False, True, False) and net.allreduce_slow
    assert net.bandwidths[1] == pytest.approx(12.5e6) and net.bandwidths[0] == 100e9
    assert not links(two_speed(8, 8), 4, 2).allreduce_slow  # one node: all fast
    # measured per link: each boundary at its own link's (the slowest replica's)
    measured = NetworkProfile(1e-4, 1e6, 1e-4, 1e6, 4, (1e-4,) * 3, (5e8, 1e6, 4e8))
    net = links(two_speed(4, 1), 2, 2, measured)
    assert net.bandwidths == [4e8] and net.slow == (True,)  # links 0 and 2: min(5e8, 4e8)


def test_the_partition_weighs_each_boundary_by_its_link() -> None:
    """Twelve equal nodes in three stages; small cuts at 3 and 9. With every link fast the
    stages are four nodes each; with the second boundary slow, it moves to the small cut."""
    cut = np.full(13, 10.0)
    cut[[0, 12]], cut[[3, 9]] = 0.0, 1.0
    problem = PartitionProblem(np.ones(12), np.zeros(12), np.zeros(12), cut, bandwidth=1e9,
                               recompute=False)
    assert partition(problem, 3).bounds == (0, 4, 8, 12)
    slow = partition(dataclasses.replace(problem, bandwidths=(1e9, 1.0)), 3)
    assert slow.bounds[2] == 9 and slow.bounds == (0, 5, 9, 12)


def test_a_slow_cut_goes_between_blocks_not_inside_one() -> None:
    """The bench's GPT (issue 31, bench/RESULTS.md "Slow links") at P=2 x D=2 over 100 Mbit/s
    cut inside block 2 after ln1 (two tensors cross) to move a LayerNorm's gradient across:
    the boundary sends one tensor now."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from slow_links_systems import gpt_layers

    model = gpt_layers(GPTConfig(vocab_size=8000, block_size=32, n_layer=2, n_head=4,
                                 n_embd=128))
    pipe = vf.compile(model, two_speed(4, 1), example_inputs=(torch.randint(0, 256, (8, 32)),),
                      loss_fn=lm_loss, stages=2, data_parallel=2, micro_batch_size=2,
                      global_batch_size=16)
    assert len(pipe.stages[0].spec.sends) == 1, [t.name for t in pipe.stages[0].spec.sends]


def test_auto_compresses_only_the_slow_boundary_and_the_plan_says_so() -> None:
    found = plan(two_speed(4, 2), stages=4, compression="auto")
    assert [b.link for b in found.boundaries] == ["within a node", "between nodes",
                                                   "within a node"]
    assert found.compression[0] == found.compression[2] == "off"
    assert found.compression[1] in ("bf16", "int8")
    row = found.boundaries[1]
    assert row.compression == found.compression[1] and row.wire_bytes < row.nbytes / 1.9
    text = str(found)
    assert "pipeline boundaries" in text and "between nodes" in text
    assert "departs from eager numerics" in text
    # the same job with every link fast: nothing pays, nothing departs
    fast = plan(vf.Cluster(gpus=4, gpus_per_node=4, device="cpu"), stages=4,
                compression="auto")
    assert fast.compression == ("off",) * 3 and not fast.departs_from_eager


def test_compression_and_sync_lower_the_predicted_step_where_links_are_slow(
        graph: object) -> None:
    cluster, layout = two_speed(4, 1), {"stages": 2, "data_parallel": 2}
    exact = best(graph, cluster, **layout)
    int8 = best(graph, cluster, compression="int8", **layout)
    psgd = best(graph, cluster, replica_sync=vf.PowerSGD(rank=2), **layout)
    diloco = best(graph, cluster, replica_sync=vf.DiLoCo(every=10), **layout)
    assert exact.compression == ("off",) and int8.compression == ("int8",)
    assert int8.step_time < exact.step_time
    assert psgd.sync == (vf.PowerSGD(rank=2),) * 2 and psgd.step_time < exact.step_time
    assert diloco.allreduce_time < psgd.allreduce_time < exact.allreduce_time
    assert wire_bytes(4096, "int8", rows=32) == 1024 + 4 * 32


def test_auto_sync_picks_per_stage_from_the_link_its_replicas_share(graph: object) -> None:
    layout = {"stages": 2, "data_parallel": 2, "replica_sync": "auto"}
    assert best(graph, two_speed(4, 2), **layout).sync == (vf.PowerSGD(rank=4),) * 2
    assert best(graph, two_speed(4, 4), **layout).sync == ("exact",) * 2  # one node
    # compile says so; ZeRO-1 would add half an all-reduce over the slow link, and memory
    # does not need it: "auto" leaves the optimizer state whole there
    slow = plan(two_speed(4, 2), stages=2, data_parallel=2, replica_sync="auto")
    assert slow.replica_sync == (vf.PowerSGD(rank=4),) * 2 and slow.departs_from_eager
    assert not slow.shards_by_default and not slow.shard_optimizer
    assert "not sharded (shard_optimizer='auto'" in str(slow)
