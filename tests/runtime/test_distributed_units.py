"""Pieces of the distributed runtime that need no second process: placement, timeouts,
buckets, and the one-process versions of clipping and mixed precision."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import varuna_fx as vf
from support.dist import SCRIPTS
from support.training import make_model_and_data
from varuna_fx.examples import lm_loss
from varuna_fx.ir.nodes import Affine, StageSpec, TensorInfo, Transfer, b
from varuna_fx.runtime.acks import release_keys
from varuna_fx.runtime.comm import _buckets
from varuna_fx.runtime.precision import LossScaler
from varuna_fx.schedule import Action, Kind, build_schedule
from varuna_fx.schedule.placement import Placement, check_world_size
from varuna_fx.world.where import resolve_timeout

# -- placement -------------------------------------------------------------------------------


@pytest.mark.parametrize("P,D", [(1, 4), (2, 2), (3, 2), (4, 1)])
def test_placement_is_replica_major_and_invertible(P: int, D: int) -> None:
    place = Placement(P, D)
    assert sorted(place.rank(s, r) for s in range(P) for r in range(D)) == list(range(P * D))
    for rank in range(P * D):
        stage, replica = place.coords(rank)
        assert place.rank(stage, replica) == rank == replica * P + stage
    assert place.pipeline_ranks(1 % D) == list(range((1 % D) * P, (1 % D) * P + P))
    assert place.replica_ranks(0) == [r * P for r in range(D)]


def test_world_size_error_says_both_numbers_and_the_fix() -> None:
    check_world_size(4, 2, 2)
    with pytest.raises(vf.DistributedError, match=r"3 ranks.*2 x 2 = 4.*--nproc 4"):
        check_world_size(3, 2, 2)
    with pytest.raises(vf.DistributedError, match=r"data_parallel=3"):
        check_world_size(6, 2, 2)


# -- timeouts and buckets --------------------------------------------------------------------


def test_timeout_from_keyword_env_or_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VARUNA_FX_TIMEOUT", raising=False)
    assert resolve_timeout(None) == 300.0
    assert resolve_timeout(5) == 5.0
    monkeypatch.setenv("VARUNA_FX_TIMEOUT", "7.5")
    assert resolve_timeout(None) == 7.5
    assert resolve_timeout(2) == 2.0  # the keyword wins
    with pytest.raises(vf.VarunaFxError, match="positive"):
        resolve_timeout(0)
    monkeypatch.setenv("VARUNA_FX_TIMEOUT", "soon")
    with pytest.raises(vf.VarunaFxError, match="not a number"):
        resolve_timeout(None)


def test_buckets_respect_size_and_dtype() -> None:
    tensors = [torch.zeros(100), torch.zeros(100), torch.zeros(10, dtype=torch.float64),
               torch.zeros(300), torch.zeros(50)]
    buckets = _buckets(tensors, limit=800)  # bytes: two 100-float tensors fill one bucket
    assert [[t.numel() for t in b] for b in buckets] == [[100, 100], [300], [50], [10]]
    assert sum(len(b) for b in buckets) == len(tensors)


def _chain_specs(P: int) -> list[StageSpec]:
    """Stage s sends 'h<s>' to s+1, and stage 0 also sends a skip 'skip' to the last stage."""
    info = TensorInfo((b, 4), torch.float32)
    transfers = [Transfer(f"h{s}", s, s + 1, info, Affine(), True) for s in range(P - 1)]
    if P > 2:
        transfers.append(Transfer("skip", 0, P - 1, info, Affine(), True))
    return [StageSpec(s, [], [t for t in transfers if t.dst == s],
                      [t for t in transfers if t.src == s], [], [], []) for s in range(P)]


@pytest.mark.parametrize("schedule", ["varuna", "1f1b", "gpipe"])
@pytest.mark.parametrize("P", [2, 3, 4])
def test_send_release_proofs_are_sound(schedule: str, P: int) -> None:
    """A send is released by a message the peer sends only after consuming it."""
    sched = build_schedule(schedule, P, 6, recompute=True)
    specs = _chain_specs(P)
    for me in range(P):
        proofs = release_keys(me, sched.per_stage, specs)
        expected = {(t.name, t.dst) for t in specs[me].sends} | \
            {(t.name, t.src) for t in specs[me].recvs}
        assert {(k[1], k[2]) for k in proofs} == expected
        for (kind, _name, peer, mb), proof in proofs.items():
            peer_list = sched.per_stage[peer]
            consumed = peer_list.index(Action(peer, Kind.F if kind == "activation" else Kind.B, mb))
            if proof is None:
                continue
            sent = peer_list.index(Action(peer, Kind.B if proof[0] == "gradient" else Kind.F,
                                          proof[3]))
            assert proof[2] == peer and sent >= consumed
        if me == 0 and P > 1:  # steady state: activations come back as gradients
            assert sum(v is not None for v in proofs.values()) >= len(proofs) // 2


# -- one process: clipping and precision -----------------------------------------------------


def _compiled(precision: str = "fp32", stages: int = 2) -> tuple:
    model, tokens = make_model_and_data()
    eager = copy.deepcopy(model)
    batch = tokens[0]
    pipe = vf.compile(model, example_inputs=(batch[:, :-1],), loss_fn=lm_loss, stages=stages,
                      micro_batch_size=2, precision=precision)
    return pipe, eager, batch


@pytest.mark.slow  # compiles a fresh model
def test_clip_grad_norm_matches_torch_in_one_process() -> None:
    pipe, eager, batch = _compiled()
    pipe.step(batch[:, :-1], target=batch[:, 1:])
    lm_loss(eager(batch[:, :-1]), batch[:, 1:]).backward()
    want = torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.5)
    got = pipe.clip_grad_norm_(0.5)
    torch.testing.assert_close(got, want)
    grads = dict(eager.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6)
    assert pipe.stage_index == 0 and pipe.replica_index == 0


@pytest.mark.slow  # compiles a fresh model
def test_bf16_matches_eager_autocast_in_one_process() -> None:
    pipe, eager, batch = _compiled("bf16")
    loss = pipe.step(batch[:, :-1], target=batch[:, 1:])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = lm_loss(eager(batch[:, :-1]), batch[:, 1:])
    want.backward()
    torch.testing.assert_close(torch.as_tensor(loss), want.detach().float(), rtol=2e-2, atol=2e-2)
    grads = dict(eager.named_parameters())
    for name, p in pipe.named_parameters():
        assert p.grad.dtype == torch.float32  # master gradients stay fp32
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=0.1, atol=2e-2)


@pytest.mark.slow  # compiles a fresh model
def test_fp16_scales_the_loss_and_unscales_the_gradients() -> None:
    pipe, eager, batch = _compiled("fp16")
    assert pipe.loss_scale == 2.0**16
    loss = pipe.step(batch[:, :-1], target=batch[:, 1:])
    with torch.autocast("cpu", dtype=torch.float16):
        want = lm_loss(eager(batch[:, :-1]), batch[:, 1:])
    want.backward()
    assert not pipe.found_inf
    torch.testing.assert_close(torch.as_tensor(loss), want.detach().float(), rtol=1e-2, atol=1e-2)
    grads = dict(eager.named_parameters())
    for name, p in pipe.named_parameters():  # unscaled: the size of eager's gradients
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=0.1, atol=2e-2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    before = [p.detach().clone() for p in pipe.parameters()]
    assert pipe.optimizer_step(opt)
    assert any(not torch.equal(a, p) for a, p in zip(before, pipe.parameters()))


def test_fp16_overflow_skips_the_step_and_backs_off() -> None:
    pipe, _, batch = _compiled("fp16")
    pipe.runtime.scaler.scale = 2.0**120  # any fp16 backward overflows at this scale
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    before = [p.detach().clone() for p in pipe.parameters()]
    loss = pipe.step(batch[:, :-1], target=batch[:, 1:])
    assert math.isfinite(float(loss))  # the reported loss is the unscaled one
    assert pipe.found_inf
    assert not pipe.optimizer_step(opt)
    assert all(torch.equal(a, p) for a, p in zip(before, pipe.parameters()))
    assert pipe.loss_scale == 2.0**119


def test_loss_scaler_grows_after_clean_steps() -> None:
    scaler = LossScaler(enabled=True, init_scale=8.0, growth_interval=2)
    for _ in range(2):
        scaler.found_inf = False
        scaler.update()
    assert scaler.scale == 16.0
    off = LossScaler(enabled=False)
    assert off.scale == 1.0 and not off.unscale_([])


def test_the_loss_scale_carries_on_through_its_state() -> None:
    """What checkpoints and joining processes carry (``state_dict``/``load_state_dict``): the
    scale and the clean steps towards its next growth; a disabled scaler stays at 1."""
    scaler = LossScaler(enabled=True, init_scale=8.0, growth_interval=3)
    scaler.update()
    scaler.update()
    other = LossScaler(enabled=True, growth_interval=3)
    other.load_state_dict(scaler.state_dict())
    assert other.state_dict() == {"scale": 8.0, "clean_steps": 2}
    other.update()  # the third clean step grows it, as it would have grown the first
    assert other.scale == 16.0
    off = LossScaler(enabled=False)
    off.load_state_dict(scaler.state_dict())
    assert off.scale == 1.0


def test_unknown_precision_is_rejected() -> None:
    with pytest.raises(vf.VarunaFxError, match="precision='fp8'"):
        _compiled("fp8")


# -- launching -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_varuna_fx_run_launches_ranks(tmp_path: Path) -> None:
    """`varuna-fx run --nproc 2 script` (torchrun underneath) gives each rank its stage."""
    done = subprocess.run(
        [sys.executable, "-m", "varuna_fx.launch.cli", "run", "--nproc", "2",
         str(SCRIPTS / "cli_smoke.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(p.read_text() for p in tmp_path.glob("rank*.txt"))
    assert [line.split(" loss ")[0] for line in lines] == \
        ["rank 0 stage 0 replica 0", "rank 1 stage 1 replica 0"]
    assert len({line.split(" loss ")[1] for line in lines}) == 1  # every rank: the same loss


def test_step_loop_returns_the_flags_it_was_given_in_one_process() -> None:
    """The hook for flags that ride the step's world all-reduce (one process: nothing to OR)."""
    model, tokens = make_model_and_data()
    pipe = vf.compile(model, example_inputs=(tokens[0, :, :-1],), loss_fn=lm_loss, stages=2)
    batch = tokens[0]
    inputs = pipe._bind((batch[:, :-1],), {})
    loss = pipe.runtime.step(inputs, batch[:, 1:], flags=(True, False))
    assert pipe.runtime.flags == (True, False)
    pipe.zero_grad()
    torch.testing.assert_close(torch.as_tensor(loss),
                               torch.as_tensor(pipe.step(batch[:, :-1], target=batch[:, 1:])))
    assert pipe.runtime.flags == (False,)  # pipe.step carries the preemption flag


def test_a_rank_s_model_object_refuses_state_dict_after_its_stages_are_released() -> None:
    """A distributed rank empties the other stages' tensors of the user's model; saving
    ``model.state_dict()`` would silently write empty tensors, so it raises, saying what to use."""
    from varuna_fx.runtime.setup import release_unheld

    model, tokens = make_model_and_data()
    x = tokens[0, :, :-1]
    whole = copy.deepcopy(model)
    pipe = vf.compile(copy.deepcopy(model), example_inputs=(x,), loss_fn=lm_loss, stages=2,
                      micro_batch_size=2)
    # stage 1's module shares its tensors with the pipeline's own model object
    release_unheld(pipe.model, pipe.stages[1], torch.device("cpu"))
    with pytest.raises(vf.DistributedError, match=r"holds only stage 1.*pipe\.save_checkpoint"):
        pipe.model.state_dict()
    with pytest.raises(vf.DistributedError, match="model.load_state_dict"):
        pipe.model.load_state_dict(whole.state_dict())
    # a rank that holds every tensor (P=1 with replicas) keeps a usable model object
    solo = vf.compile(whole, example_inputs=(x,), loss_fn=lm_loss, stages=1)
    release_unheld(solo.model, solo.stages[0], torch.device("cpu"))
    assert set(solo.model.state_dict()) == set(model.state_dict())
