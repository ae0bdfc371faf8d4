"""pipe.last_step (one process): what a step measured, its timeline of every action, and the
byte counts of messages and collectives."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.runtime.traffic import Counter as Traffic


@pytest.fixture(scope="module")
def pipe() -> vf.Pipeline:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
    return vf.compile(GPT(cfg), vf.Cluster(gpus=2, device="cpu"),
                      (torch.zeros(8, 8, dtype=torch.long),), loss_fn=lm_loss, stages=2,
                      micro_batch_size=2, schedule="varuna", recompute=True)


def test_last_step_measures_the_step(pipe: vf.Pipeline) -> None:
    assert pipe.last_step is None or pipe.last_step.samples == 8
    x = torch.randint(0, 64, (8, 8))
    pipe.step(x, target=x)
    first = pipe.last_step
    assert first is not None
    assert first.samples == 8 and first.tokens == 64  # one process: the whole global batch
    assert first.predicted_seconds == pipe.plan.predicted_step_time
    assert first.seconds > 0 and first.peak_memory > 2**20 and first.bytes_sent == 0
    pipe.step(x, target=x)
    assert pipe.last_step is not first


def test_the_timeline_holds_every_action_of_the_schedule_once(pipe: vf.Pipeline) -> None:
    x = torch.randint(0, 64, (8, 8))
    pipe.step(x, target=x)
    timeline = pipe.last_step.timeline
    m, p = pipe.plan.num_micro_batches, pipe.plan.stages
    kinds = Counter((a.stage, a.kind) for a in timeline)
    expected = {(s, "F"): m for s in range(p)} | {(s, "B"): m for s in range(p)} | \
        {(s, "R"): m for s in range(p) if pipe.plan.recompute[s]}
    assert dict(kinds) == expected
    assert sorted(a.mb for a in timeline if a.kind == "F" and a.stage == 0) == list(range(m))
    ends = [a.end for a in timeline]
    assert all(0 <= a.start <= a.end for a in timeline)
    assert ends == sorted(ends)  # one process: one action at a time
    assert ends[-1] <= pipe.last_step.seconds


def test_the_timeline_can_be_turned_off(pipe: vf.Pipeline) -> None:
    x = torch.randint(0, 64, (8, 8))
    pipe._meter.record_timeline = False
    try:
        pipe.step(x, target=x)
        assert pipe.last_step.timeline == []
    finally:
        pipe._meter.record_timeline = True


def test_tokens_are_counted_from_integer_inputs_only() -> None:
    from varuna_fx.runtime.step_stats import token_count

    assert token_count({"x": torch.zeros(4, 3)}) is None
    assert token_count({"x": torch.zeros(4, 3), "ids": torch.zeros(4, 5, dtype=torch.long)}) == 20


def test_collectives_count_what_a_ring_sends(monkeypatch: Any) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    sent = Traffic()
    t = torch.zeros(1000)  # 4000 bytes
    sent.send(t)
    assert sent.total == 4000
    sent.all_reduce(t, None)
    assert sent.total == 4000 + 6000  # 2 (n-1)/n
    sent.scatter_or_gather(t, None)
    assert sent.total == 10000 + 3000  # (n-1)/n
    sent.broadcast(t, src=0)
    assert sent.total == 13000  # only the root sends
    sent.broadcast(t, src=1)
    assert sent.total == 17000
