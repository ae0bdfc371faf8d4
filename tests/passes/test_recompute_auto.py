"""recompute="auto" (the default): recompute only on the stages whose memory needs it."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig, lm_loss
from varuna_fx.passes.partition import PartitionProblem, partition


def _gpt() -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=4, n_head=2, n_embd=32))
    tokens = torch.randint(0, 64, (8, 9))
    return model, tokens[:, :-1], tokens[:, 1:]


def _step_equals_eager(pipe: vf.Pipeline, model: GPT, x: torch.Tensor, y: torch.Tensor) -> None:
    reference = copy.deepcopy(model)
    ref_loss = lm_loss(reference(x), y)
    ref_loss.backward()
    pipe.zero_grad()
    loss = pipe.step(x, target=y)
    torch.testing.assert_close(torch.as_tensor(loss), ref_loss.detach())
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, msg=name)


# the default path (nothing recomputes) runs in most fast-tier compiles; checked here in full
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["varuna", "1f1b-zb"])
def test_plentiful_memory_recomputes_nowhere(schedule: str) -> None:
    model, x, y = _gpt()
    pipe = vf.compile(model, example_inputs=(x,), loss_fn=lm_loss, stages=4,
                      micro_batch_size=2, schedule=schedule)
    assert pipe.plan.recompute == (False,) * 4
    assert not any(a.kind is vf.schedule.Kind.R for a in pipe.plan.schedule.actions)
    assert " + recompute" not in str(pipe.plan)
    _step_equals_eager(pipe, model, x, y)


@pytest.mark.parametrize("schedule", [pytest.param("varuna", marks=pytest.mark.slow), "varuna-zb"])
def test_tight_memory_recomputes_early_stages(schedule: str) -> None:
    model, x, y = _gpt()
    # fits with recompute on the early stages (which stash the most), not without
    tight = vf.Cluster(gpus=1, gpu_memory="340KiB", device="cpu")
    pipe = vf.compile(model, tight, example_inputs=(x,), loss_fn=lm_loss, stages=4,
                      micro_batch_size=2, schedule=schedule)
    flags = pipe.plan.recompute
    assert flags[0] and not flags[-1]
    assert pipe.plan.schedule.recompute_stages == flags
    stage_table = str(pipe.plan).split("└", 1)[0]  # (the boundaries table follows)
    rows = [line for line in stage_table.splitlines() if line.startswith("│")]
    assert [row.split("│")[-3].strip() for row in rows] == \
        ["yes" if f else "no" for f in flags]
    _step_equals_eager(pipe, model, x, y)
    with pytest.raises(vf.VarunaFxError, match="fits"):
        vf.compile(model, tight, example_inputs=(x,), loss_fn=lm_loss, stages=4,
                   micro_batch_size=2, recompute=False)


@pytest.mark.slow  # two more compiles of a fresh model
def test_forced_settings_and_bad_values() -> None:
    model, x, _ = _gpt()
    on = vf.compile(model, example_inputs=(x,), loss_fn=lm_loss, stages=3, micro_batch_size=2,
                    recompute=True)
    off = vf.compile(model, example_inputs=(x,), loss_fn=lm_loss, stages=3, micro_batch_size=2,
                     recompute=False)
    assert (on.plan.recompute, off.plan.recompute) == ((True, True, False), (False,) * 3)
    for bad in ("yes", 1, None):
        with pytest.raises(vf.VarunaFxError, match="recompute="):
            vf.compile(model, example_inputs=(x,), loss_fn=lm_loss, stages=3, recompute=bad)


def test_partition_prices_each_stage_with_its_own_choice() -> None:
    # 4 equal nodes; plain (no recompute) costs 2 per node, recomputing 3; a plain stage holds
    # its input (1 byte) and 10 bytes of activations per node for each micro-batch in flight (2
    # on stage 0, 1 on the last), a recomputing one only its input per micro-batch plus one
    # replay. Room for 25 bytes.
    n = 4
    costs = PartitionProblem(
        compute=torch.full((n,), 3.0).numpy(), weight_bytes=torch.zeros(n).numpy(),
        activation_bytes=torch.full((n,), 10.0).numpy(), cut_bytes=torch.ones(n + 1).numpy(),
        memory_cap=25.0, stash_counts=(2, 1), recompute="auto",
        last_stage_compute=torch.full((n,), 2.0).numpy(),
    )
    result = partition(costs, 2)
    # stage 0 as [0, 2) stashes 2 x 21 bytes plain: it recomputes (cost 2 x 3, memory
    # 2 x 1 + 20); the last stage never recomputes and keeps its plain cost 2 x 2 (memory
    # 1 x (1 + 20))
    assert result.bounds == (0, 2, 4)
    assert result.recompute == (True, False)
    assert result.stage_times == (6.0, 4.0)
    assert result.stage_memory == (22.0, 21.0)
    roomy = partition(dataclasses.replace(costs, memory_cap=1e9), 2)
    assert roomy.recompute == (False, False) and roomy.stage_times == (4.0, 4.0)
