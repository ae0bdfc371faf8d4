"""pipe.shard: each data-parallel replica's contiguous share of a global batch.

Distributed replicas are faked in one process (replica/replicas given explicitly): D replicas
that each step on their shard and average gradients (what the data-parallel all-reduce does)
must equal eager PyTorch on the whole global batch."""

from __future__ import annotations

import pytest
import torch

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.pipeline import Pipeline
from varuna_fx.runtime.shard import shard_batch


def test_shards_are_contiguous_and_cover_the_batch_for_tensors_tuples_and_dicts() -> None:
    x = torch.arange(12).view(6, 2)
    y = torch.arange(6)
    got = [shard_batch({"x": x, "pair": (y, "keep"), "scale": torch.tensor(2.0)}, r, 3)
           for r in range(3)]
    for r, part in enumerate(got):
        torch.testing.assert_close(part["x"], x[2 * r:2 * r + 2])
        torch.testing.assert_close(part["pair"][0], y[2 * r:2 * r + 2])
        assert part["pair"][1] == "keep"
        torch.testing.assert_close(part["scale"], torch.tensor(2.0))  # 0-d: kept whole
    torch.testing.assert_close(torch.cat([p["x"] for p in got]), x)
    assert shard_batch(x, 1, 2).shape == (3, 2)
    assert isinstance(shard_batch([x, y], 0, 2), list)


def test_shard_refuses_batches_that_do_not_split() -> None:
    with pytest.raises(vf.InputError, match="multiple of 4"):
        shard_batch(torch.zeros(6, 3), 0, 4)
    with pytest.raises(vf.InputError, match="disagree"):
        shard_batch((torch.zeros(6), torch.zeros(4)), 0, 2)
    with pytest.raises(vf.InputError, match="replica 2 of 2"):
        shard_batch(torch.zeros(6), 2, 2)


def test_replicas_stepping_on_their_shards_equal_eager_on_the_global_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, vocab_size=64, block_size=8))
    tokens = torch.randint(0, 64, (8, 9))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    pipe = vf.compile(model, example_inputs=(inputs[:4],), loss_fn=lm_loss, stages=2)
    # one process runs every replica's work itself: its share is the whole batch
    assert pipe.replicas == 1
    torch.testing.assert_close(pipe.shard((inputs, targets))[0], inputs)

    # fake replica r of 2, as each rank of a D=2 job would be
    monkeypatch.setattr(Pipeline, "replicas", property(lambda self: 2))
    losses, grads = [], []
    for r in range(2):
        monkeypatch.setattr(pipe, "replica_index", r)
        x, y = pipe.shard((inputs, targets))
        assert x.shape[0] == 4
        pipe.zero_grad()
        losses.append(float(pipe.step(x, target=y)))
        grads.append({n: p.grad.clone() for n, p in pipe.named_parameters()})
    model.zero_grad()
    eager = lm_loss(model(inputs), targets)
    eager.backward()
    torch.testing.assert_close(torch.tensor(sum(losses) / 2), eager.detach())
    for name, p in model.named_parameters():
        torch.testing.assert_close((grads[0][name] + grads[1][name]) / 2, p.grad,
                                   rtol=1e-4, atol=1e-6)
