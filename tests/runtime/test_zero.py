"""Sharded optimizer state (ZeRO-1, runtime/sync/zero.py): float64 AdamW with param groups, an LR
schedule and clipping under (P, D) = (1, 2), (2, 2), (2, 3) on gloo ranks equals eager on the
whole batch (tied embedding and LM head included); checkpoints move between one process,
sharded and unsharded layouts and continue exactly; "auto" shards pipe.optimizer's optimizer
and leaves a direct one unsharded; the refusals; state per rank ~1/D; bf16 and fp16 sharded
equal unsharded, and so do gradients accumulated over two steps; what training loops do to
`.grad` (torch's clip_grad_norm_, edits, opt.zero_grad()) equals unsharded and eager. One launch
per world size runs several jobs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import varuna_fx as vf
from support.dist import run_jobs
from support.training import ckpt_model
from support.zero import (
    LOOPS,
    MAX_NORM,
    SPLIT,
    STEPS,
    TOL,
    eager_loop,
    eager_training,
    make_optimizer,
    schedule,
    tokens,
)
from varuna_fx.costs.memory import held_copies, sharded_held
from varuna_fx.examples import lm_loss


def run(out: Path, nproc: int, jobs: list[dict[str, Any]]) -> dict[str, list[dict]]:
    out.mkdir(parents=True, exist_ok=True)
    collected = run_jobs(out, nproc, jobs, script="zero_jobs.py", timeout=400)
    for name, per_rank in collected.items():
        for r, result in enumerate(per_rank):
            assert "error" not in result, f"{name} rank {r}: {result}"
    return collected


def one_process(stages: int, *, save: Path | None = None,
                load: Path | None = None) -> dict[str, torch.Tensor]:
    """Train to STEPS in one process with pipe.optimizer (a plain optimizer here)."""
    pipe = vf.compile(ckpt_model(seed=7 if load else 0), example_inputs=(tokens()[0, :, :-1],),
                      loss_fn=lm_loss, stages=stages, micro_batch_size=2)
    opt = make_optimizer(pipe.named_parameters(), pipe.optimizer)
    assert type(opt) is torch.optim.AdamW
    sched = schedule(opt)
    start = 0
    if load is not None:
        extra = pipe.load_checkpoint(str(load), optimizer=opt)
        sched.load_state_dict(extra["sched"])
        start = extra["step"]
    data = tokens()
    for step in range(start, STEPS):
        if step == SPLIT and save is not None:
            pipe.save_checkpoint(str(save), optimizer=opt,
                                 extra={"step": SPLIT, "sched": sched.state_dict()})
        pipe.zero_grad()
        pipe.step(data[step, :, :-1], target=data[step, :, 1:])
        pipe.clip_grad_norm_(MAX_NORM)
        pipe.optimizer_step(opt)
        sched.step()
    return pipe.state_dict()


def check(state: dict[str, torch.Tensor], eager: dict[str, torch.Tensor], where: str,
          **tol: float) -> None:
    """``tol``: assert_close's (default TOL, float64's; compiled stages: inductor reorders
    sums, docs/API.md "Compiled stages")."""
    assert state, where
    for name, value in state.items():
        torch.testing.assert_close(value, eager[name], **(tol or TOL),
                                   msg=lambda m, n=name: f"{n} ({where}): {m}")


def test_memory_model_counts_sharded_state() -> None:
    """A trainable weight: itself, its gradient and Adam's two moments / D."""
    assert [held_copies(d) for d in (1, 2, 4)] == [4, 3, 2.5]
    held = sharded_held(np.array([4.0 * 100, 1.0 * 50]), np.array([100.0, 0.0]), 4)
    assert held.tolist() == [250.0, 50.0]  # a buffer (no gradient) is not optimizer state


def test_shard_optimizer_argument_is_checked() -> None:
    with pytest.raises(vf.VarunaFxError, match="shard_optimizer='yes'"):
        vf.compile(ckpt_model(), example_inputs=(tokens()[0, :, :-1],), loss_fn=lm_loss,
                   stages=1, shard_optimizer="yes")


def test_one_process_optimizer_is_plain() -> None:
    pipe = vf.compile(ckpt_model(), example_inputs=(tokens()[0, :, :-1],), loss_fn=lm_loss,
                      stages=2, micro_batch_size=2, shard_optimizer=True)
    opt = pipe.optimizer(torch.optim.LBFGS, lr=1.0)  # D = 1: nothing to shard, any class
    assert {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for p in pipe.parameters()}
    with pytest.raises(vf.OptimizerError, match="torch.optim.Optimizer class"):
        pipe.optimizer(torch.nn.Linear)
    with pytest.raises(vf.OptimizerError, match="not one of this rank's parameters"):
        pipe.optimizer(torch.optim.SGD, [torch.zeros(2, requires_grad=True)], lr=1.0)


@pytest.mark.slow
@pytest.mark.distributed
def test_sharded_training_and_checkpoints_equal_eager(tmp_path: Path) -> None:
    eager = eager_training()
    ck = tmp_path / "ck"
    check(one_process(2, save=ck / "one"), eager, "one process P=2, saved")

    two = run(tmp_path / "w2", 2, [
        {"name": "t12", "kind": "train", "P": 1, "D": 2, "path": str(ck / "s12")},
        {"name": "r12", "kind": "resume", "P": 1, "D": 2, "path": str(ck / "one")},
        {"name": "refuse", "kind": "refusals", "P": 1, "D": 2},
        {"name": "precision", "kind": "precision", "P": 1, "D": 2},
        {"name": "loops", "kind": "loops", "P": 1, "D": 2},
    ])
    four = run(tmp_path / "w4", 4, [
        {"name": "t22", "kind": "train", "P": 2, "D": 2, "path": str(ck / "s22")},
        {"name": "r22", "kind": "resume", "P": 2, "D": 2, "path": str(ck / "s12")},
        {"name": "r22off", "kind": "resume", "P": 2, "D": 2, "shard": False,
         "path": str(ck / "s12")},
        {"name": "accumulate", "kind": "accumulate", "P": 2, "D": 2},
        {"name": "loops", "kind": "loops", "P": 2, "D": 2},
        # compiled stages (issue 43 item 2) under torchrun, ZeRO-1, the tied embedding and
        # head on two stages, clipping: eager's training within inductor's reordering
        {"name": "t22compiled", "kind": "train", "P": 2, "D": 2, "compiled": True},
    ])
    six = run(tmp_path / "w6", 6, [
        {"name": "t23", "kind": "train", "P": 2, "D": 3, "shard": "auto"},  # D > 1: shards
        {"name": "r23", "kind": "resume", "P": 2, "D": 3, "path": str(ck / "s22")},
        # "auto" and torch's own AdamW over pipe.parameters(): unsharded, as before
        {"name": "r23direct", "kind": "resume", "P": 2, "D": 3, "shard": "auto",
         "direct": True, "path": str(ck / "s12")},
    ])
    check(one_process(1, load=ck / "s22"), eager, "one process P=1 from sharded (2, 2)")

    for name, results in [*two.items(), *four.items(), *six.items()]:
        if name in ("refuse", "precision", "accumulate", "loops"):
            continue
        for r, result in enumerate(results):
            check(result["state"], eager, f"{name} rank {r}",
                  **({"rtol": 1e-7, "atol": 1e-9} if "compiled" in name else TOL))
            assert result["sharded"] == (name not in ("r22off", "r23direct")), name

    # optimizer state per rank: 1/D of the stage's (AdamW's two moments), give or take padding
    for r in range(4):
        sharded, whole = four["t22"][r]["state_bytes"], four["r22off"][r]["state_bytes"]
        assert whole / 2 - 64 <= sharded <= whole / 2 + 2 * 8 * 2 + 64, (r, sharded, whole)
    unsharded_stage0 = four["r22off"][0]["state_bytes"]
    assert six["t23"][0]["state_bytes"] <= unsharded_stage0 / 3 + 2 * 8 * 3 + 64

    refused = two["refuse"][0]
    assert refused["lbfgs"][0] == "OptimizerError" and "varuna_fx_elementwise" in refused["lbfgs"][1]
    assert "pipe.optimizer(torch.optim.AdamW" in refused["direct"][1]
    assert "replaced by a later pipe.optimizer" in refused["replaced"][1]
    assert "not one of this rank's parameters" in refused["not_a_parameter"][1]
    assert refused["newest"] is None

    for r, found in enumerate(four["accumulate"]):  # tied copies on both stages included
        for n, plain in found[False].items():
            torch.testing.assert_close(found[True][n], plain, **TOL,
                                       msg=lambda m, n=n, r=r: f"accumulated {n} rank {r}: {m}")

    check_loops(two["loops"], four["loops"])

    found = two["precision"][0]
    for prec in ("bf16", "fp16"):
        sharded, plain = found[(prec, True)], found[(prec, False)]
        for n in plain:
            torch.testing.assert_close(sharded[n], plain[n], rtol=1e-12, atol=1e-14)
        assert found[(prec, True, "scale")] == found[(prec, False, "scale")]


def check_loops(p1: list[dict], p2: list[dict]) -> None:
    """What training loops do to ``.grad`` under ZeRO-1 (issue 30): the same as unsharded on
    every rank, and at P = 1 (every rank holds the whole model) the same as eager."""
    for loop in LOOPS:
        eager = eager_loop(loop)
        for r, found in enumerate(p1):
            check(found[(loop, True)], eager, f"{loop} sharded P=1 rank {r}")
            check(found[(loop, False)], eager, f"{loop} unsharded P=1 rank {r}")
        for r, found in enumerate(p2):
            check(found[(loop, True)], found[(loop, False)], f"{loop} P=2 rank {r}")
    for r, found in enumerate([*p1, *p2]):
        assert found["none"] and "h.0.fc.weight.grad is None" in found["none"] or \
            "h.1.fc.weight.grad is None" in found["none"], (r, found["none"])
        assert "shard_optimizer=False" in found["none"]


def test_planner_shards_where_it_lets_a_shallower_pipeline_fit() -> None:
    """A GPT whose weights dominate, on 2 devices of one node: in 45 MiB one replica of the
    whole model fits only with its Adam state halved, so "auto" runs it data-parallel (P=1,
    D=2, sharded), faster than the two-stage pipeline that False must fall back to."""
    from varuna_fx.examples import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=8, n_layer=4, n_head=4, n_embd=256))
    x = torch.randint(0, 256, (8, 8))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())

    def plan(shard: bool | str, memory: str = "45MiB") -> vf.Plan:
        cluster = vf.Cluster(gpus=2, gpus_per_node=2, gpu_memory=memory, device="cpu")
        return vf.compile(model, cluster, example_inputs=(x,), loss_fn=lm_loss,
                          global_batch_size=8, shard_optimizer=shard).plan

    sharded, plain = plan("auto"), plan(False)
    assert (sharded.stages, sharded.data_parallel, sharded.shard_optimizer) == (1, 2, True)
    assert (plain.stages, plain.data_parallel, plain.shard_optimizer) == (2, 1, False)
    assert sharded.predicted_step_time < plain.predicted_step_time
    # the table's optimizer column: Adam's two moments, halved by the sharding
    assert sharded.stage_costs[0].optimizer_bytes == pytest.approx(weights, rel=1e-6)
    assert sum(s.optimizer_bytes for s in plain.stage_costs) >= 2 * weights
    assert "optimizer state sharded over D (ZeRO-1)" in str(sharded)
    assert "optimizer" in str(plain) and "MiB (ZeRO-1)" in str(sharded)  # its row
    # with room enough, "auto" does not shard; True shards whenever D > 1
    roomy = plan("auto", "80MiB")
    assert (roomy.stages, roomy.data_parallel, roomy.shard_optimizer) == (1, 2, False)
    assert plan(True, "80MiB").shard_optimizer
