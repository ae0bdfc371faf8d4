"""Issue 10: the partition never trades several times the bytes crossing for a percent of
balance, unless the links are free -- on synthetic arrays and on the GPT from the issue."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.passes.partition import PartitionProblem, partition

KIB = 2**10


def _two_cuts(bandwidth: float) -> PartitionProblem:
    """Seven units; after the light unit 3 (the even split) 1.2 MiB cross, before it only
    256 KiB, and that split is 1.3% less balanced."""
    compute = np.array([1.0, 1.0, 1.0, 0.04, 1.0, 1.0, 1.04])
    cut = np.full(8, np.inf)
    cut[[0, 7]] = 0.0
    cut[3] = 256 * KIB
    cut[4] = 1.2 * 2**20
    return PartitionProblem(compute, np.zeros(7), np.zeros(7), cut, bandwidth=bandwidth)


def test_a_slow_link_cuts_where_few_bytes_cross() -> None:
    # bytes priced at 1 GB/s (a millisecond for the difference) against a 40 ms balance gain:
    # the optimum alone sends 4.8x the bytes; the rule keeps the cut at 256 KiB
    costs = _two_cuts(bandwidth=1e9)
    exact = partition(dataclasses.replace(costs, byte_tolerance=0.0), 2)
    assert exact.bounds == (0, 4, 7)
    chosen = partition(costs, 2)
    assert chosen.bounds == (0, 3, 7)
    assert chosen.bottleneck <= exact.bottleneck * 1.02
    assert chosen.bottleneck == max(chosen.stage_times)


def test_free_links_keep_the_exact_optimum() -> None:
    assert partition(_two_cuts(bandwidth=float("inf")), 2).bounds == (0, 4, 7)


@pytest.mark.slow  # plans a GPT with a 16k-token head
def test_gpt_with_a_big_head_cuts_at_a_block_boundary_on_a_slow_link() -> None:
    """The issue's GPT (16k-vocabulary head, P=2, m=4): a block boundary sends 256 KiB per
    micro-batch; cuts inside a block send 2-5x that for about 1% better balance."""
    cfg = GPTConfig(vocab_size=16000, block_size=32, n_layer=8, n_head=8, n_embd=512)
    with torch.device("meta"):
        model = GPT(cfg)
    tokens = torch.zeros(16, cfg.block_size, dtype=torch.long)
    for link in ("100Mbit/s", "1Gbit/s", "100GB/s"):
        cluster = vf.Cluster(gpus=2, inter_node_bandwidth=link, device="cpu")
        pipe = vf.compile(model, cluster, example_inputs=(tokens,), loss_fn=lm_loss, stages=2,
                          micro_batch_size=4, recompute=False)
        sent = pipe.plan.stage_costs[0].boundary_bytes
        assert sent == 4 * cfg.block_size * cfg.n_embd * 4, (link, sent)  # one residual stream
