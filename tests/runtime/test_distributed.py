"""The distributed runtime on local gloo ranks, against eager single-process training.

Two launches cover everything (process start-up and the first compile cost seconds each):
2 ranks run (P, D) = (2, 1) and (1, 2) under both schedules, bf16, wrong batches, a wrong world
size and a stalled peer; 4 ranks run (2, 2) under both schedules and lose a rank.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import varuna_fx as vf
from support.dist import run_jobs
from support.training import (
    ADAM_EPS,
    CONFIG,
    check_against_eager,
    eager_training,
    make_model_and_data,
)
from varuna_fx.examples import GPT, lm_loss

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCHEDULES = ("varuna", "1f1b")


@pytest.fixture(scope="module")
def eager() -> dict:
    return eager_training()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    jobs = [{"name": f"P{p}D{d}_{s}", "kind": "train", "P": p, "D": d, "schedule": s}
            for p, d in ((2, 1), (1, 2)) for s in SCHEDULES]
    jobs.append({"name": "P2D1_varuna-zb", "kind": "train", "P": 2, "D": 1,
                 "schedule": "varuna-zb"})  # split backward: W actions send nothing
    jobs.append({"name": "bf16", "kind": "train", "P": 2, "D": 1, "precision": "bf16"})
    jobs.append({"name": "dropout", "kind": "train", "P": 2, "D": 1, "dropout": 0.3})
    jobs.append({"name": "dropout_D2", "kind": "train", "P": 1, "D": 2, "dropout": 0.3,
                 "micro_batch_size": {"0": 1, "1": 1}})
    jobs.append({"name": "fp16", "kind": "fp16", "P": 2, "D": 1})
    jobs.append({"name": "float64", "kind": "train", "P": 2, "D": 1, "dtype": "float64"})
    jobs.append({"name": "eval_modes", "kind": "eval_modes", "P": 2})
    jobs.append({"name": "accumulate", "kind": "accumulate", "P": 2, "D": 1})
    jobs.append({"name": "bad_batch", "kind": "bad_batch", "P": 2, "D": 1})
    jobs.append({"name": "mismatch", "kind": "mismatch", "P": 2, "D": 1,
                 "micro_batch_size": {"1": 4}})  # rank 1 plans another micro-batch size
    jobs.append({"name": "bad_world", "kind": "bad_world", "P": 3})  # P x D = 3 x 1 != 2
    jobs.append({"name": "stall", "kind": "peer_loss", "P": 2, "D": 1, "timeout": 3.0,
                 "stalls": 1, "ranks": [0]})
    # a deadline for hangs, not a time budget: a shared 2-core machine runs these slowly
    return run_jobs(tmp_path_factory.mktemp("two"), 2, jobs, timeout=300.0)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    jobs = [{"name": f"P2D2_{s}", "kind": "train", "P": 2, "D": 2, "schedule": s}
            for s in SCHEDULES]
    jobs.append({"name": "dies", "kind": "peer_loss", "P": 2, "D": 2, "timeout": 3.0,
                 "dies": 3, "ranks": [0, 1, 2]})
    return run_jobs(tmp_path_factory.mktemp("four"), 4, jobs)


@pytest.mark.parametrize("P,D", [(2, 1), (1, 2)])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_ranks_match_eager(two_ranks: dict, eager: dict, P: int, D: int,
                               schedule: str) -> None:
    check_against_eager(two_ranks[f"P{P}D{D}_{schedule}"], eager, P, D)


def test_split_backward_matches_eager(two_ranks: dict, eager: dict) -> None:
    check_against_eager(two_ranks["P2D1_varuna-zb"], eager, 2, 1)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_times_data_parallel_matches_eager(four_ranks: dict, eager: dict,
                                                    schedule: str) -> None:
    check_against_eager(four_ranks[f"P2D2_{schedule}"], eager, 2, 2)


@pytest.mark.parametrize("job,P,D", [("dropout", 2, 1), ("dropout_D2", 1, 2)])
def test_dropout_trains_as_eager_on_the_whole_batch(two_ranks: dict, job: str, P: int,
                                                    D: int) -> None:
    """Masks keyed by the sample's index in the global batch: two replicas (micro-batch 1)
    and two stages (micro-batch 2) both equal eager under ``vf.per_sample_rng``. (Not the
    train-mode outputs of ``pipe(...)``: a forward call outside a step draws unkeyed.)"""
    check_against_eager(two_ranks[job], eager_training(dropout=0.3), P, D, outputs=False)


def test_one_replica_with_dropout_equals_the_one_process_run(two_ranks: dict) -> None:
    """The one step loop: a one-replica torchrun run draws the same dropout masks as the
    one-process runtime, so losses, norms, parameters and outputs agree."""
    model, tokens = make_model_and_data(dropout=0.3)
    pipe = vf.compile(model, example_inputs=(tokens[0, :, :-1],), loss_fn=lm_loss, stages=2,
                      data_parallel=1, micro_batch_size=2)
    _, tokens = make_model_and_data()  # as the rank script does: the same generator state
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, eps=ADAM_EPS)
    losses, norms = [], []
    for step in range(tokens.shape[0]):
        batch = tokens[step]
        pipe.zero_grad()
        losses.append(float(pipe.step(batch[:, :-1], target=batch[:, 1:])))
        norms.append(float(pipe.clip_grad_norm_(0.5)))
        pipe.optimizer_step(opt)
    no_dropout = two_ranks["P2D1_varuna"][0]["losses"]
    assert losses != pytest.approx(no_dropout, rel=1e-3), "dropout had no effect"
    for r in two_ranks["dropout"]:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses))
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(norms))
        held = dict(pipe.named_parameters())
        for name, value in r["params"].items():
            torch.testing.assert_close(value, held[name].detach())


def test_rank_layout_is_replica_major(four_ranks: dict) -> None:
    """rank = replica * P + stage: a replica's stages sit on consecutive ranks (one node)."""
    for rank, r in enumerate(four_ranks["P2D2_varuna"]):
        assert (r["stage"], r["replica"]) == (rank % 2, rank // 2)


@pytest.mark.parametrize("job", ["P2D1_varuna", "P2D2_1f1b"])
def test_tied_copies_bit_identical(two_ranks: dict, four_ranks: dict, job: str) -> None:
    per_rank = (two_ranks | four_ranks)[job]
    tied = per_rank[0]["tied"]
    assert "wte.weight" in tied and len(tied["wte.weight"]) == 2
    copies = [r["params"]["wte.weight"] for r in per_rank if "wte.weight" in r["params"]]
    assert len(copies) == len(per_rank)  # both stages of every replica hold a copy
    for c in copies[1:]:
        assert torch.equal(c, copies[0])


@pytest.mark.parametrize("ranks,job", [("two_ranks", "P2D1_varuna"),
                                       ("four_ranks", "P2D2_varuna")])
def test_each_direction_of_a_stage_pair_has_its_own_group(ranks: str, job: str,
                                                          request: pytest.FixtureRequest) -> None:
    """NCCL runs one communicator's sends and receives in issue order, and a rank posts
    receives ahead of its sends: activations and gradients between two ranks must travel on
    two groups (one per direction), each of exactly those two ranks."""
    for r in request.getfixturevalue(ranks)[job]:
        kinds: dict[str, set[int]] = {}
        for kind, peer, members, group in r["links"]:
            assert members == sorted([r["rank"], peer]), (kind, peer, members)
            kinds.setdefault(kind, set()).add(group)
        assert set(kinds) == {"activation", "gradient"}
        assert all(len(ids) == 1 for ids in kinds.values())  # P=2: one pair, one group each way
        assert kinds["activation"] != kinds["gradient"]


def test_data_parallel_replicas_bit_identical(four_ranks: dict) -> None:
    per_rank = four_ranks["P2D2_varuna"]
    for stage in range(2):
        a, b = [r["params"] for r in per_rank if r["stage"] == stage]
        assert all(torch.equal(a[n], b[n]) for n in a)


def test_gradients_accumulate_across_steps(two_ranks: dict) -> None:
    """Without zero_grad the tied sum must count the earlier steps' gradient once."""
    model, tokens = make_model_and_data()
    for step in range(2):
        lm_loss(model(tokens[step, :, :-1]), tokens[step, :, 1:]).backward()
    want = dict(model.named_parameters())
    for r in two_ranks["accumulate"]:
        assert "wte.weight" in r["grads"]
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, want[name].grad, rtol=1e-4, atol=1e-6)


def test_bf16_matches_eager_autocast(two_ranks: dict) -> None:
    eager = eager_training(precision="bf16")
    check_against_eager(two_ranks["bf16"], eager, 2, 1, tol={"rtol": 2e-2, "atol": 2e-2},
                        autocast=torch.bfloat16)


def test_float64_model_matches_eager(two_ranks: dict) -> None:
    """Only the last stage has a loss: every rank must still all-reduce one dtype (gloo
    aborted on float32 from stage 0 against float64 from stage 1), and stage 0 returns it in
    float64 too, not rounded to float32 (issue 30)."""
    eager = eager_training(model_dtype=torch.float64)
    check_against_eager(two_ranks["float64"], eager, 2, 1, tol={"rtol": 1e-7, "atol": 1e-9})
    assert all(r["params"]["wte.weight"].dtype == torch.float64 for r in two_ranks["float64"])
    first, last = two_ranks["float64"]
    assert first["losses"] == last["losses"]  # the same float64 value on both ranks
    torch.testing.assert_close(torch.tensor(first["losses"]), torch.tensor(eager["losses"]),
                               rtol=1e-12, atol=0.0)


def test_eval_mode_of_an_exported_model_matches_eager(two_ranks: dict) -> None:
    """The eval graph is cut where each rank holds its parameters, at compile."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CONFIG, dropout=0.5)).eval()
    _, tokens = make_model_and_data()
    with torch.no_grad():
        want = model(tokens[0, :, :-1])
    for r in two_ranks["eval_modes"]:
        assert "error" not in r, r
        torch.testing.assert_close(r["eval"], want, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(r["train"], want, atol=1e-3)  # train mode: dropout again


def test_fp16_overflow_skips_the_step_on_every_rank(two_ranks: dict) -> None:
    for r in two_ranks["fp16"]:
        assert r["found_inf"] == [False, True] and r["stepped"] == [True, False]
        assert r["scale"] == 2.0**119  # backed off once, on both stages alike
        assert 0 < r["loss"] < 100  # the unscaled loss, even on the overflowing step


def test_wrong_batch_is_a_clear_error_on_every_rank(two_ranks: dict) -> None:
    for r in two_ranks["bad_batch"]:
        rows, length = r["errors"]
        assert rows[0] == "InputError" and "batch size 10" in rows[1] and "8" in rows[1]
        assert length[0] == "InputError" and "shape" in length[1]
        assert r["loss_after"] > 0  # nothing was half-sent: training goes on


def test_ranks_with_different_plans_are_named(two_ranks: dict) -> None:
    for r in two_ranks["mismatch"]:
        assert r["error"] == "DistributedError"
        assert "ranks [1] differ from rank 0" in r["message"]
        assert "micro-batch 2 x 4" in r["message"] and "micro-batch 4 x 2" in r["message"]


def test_wrong_world_size_is_a_clear_error_on_every_rank(two_ranks: dict) -> None:
    for r in two_ranks["bad_world"]:
        assert r["error"] == "DistributedError"
        assert "2 ranks" in r["message"] and "3 x 1" in r["message"]
        assert "--nproc 3" in r["message"] and "stages=" in r["message"]


def test_stalled_peer_raises_peer_timeout(two_ranks: dict) -> None:
    """Rank 1 never steps: rank 0 gives up on its gradient after the 3 s timeout."""
    (rank0,) = two_ranks["stall"]
    assert rank0["error"] == "PeerTimeoutError", rank0
    assert "stage 0 (rank 0) waited 3.0 s for the gradient" in rank0["message"]
    assert "of micro-batch 0 from stage 1 (rank 1)" in rank0["message"]
    assert 3.0 <= rank0["elapsed"] < 5.0
    # stepping on after catching it: refused at once, without blaming the timeout
    assert rank0["again"].startswith("DistributedError: stage 0 (rank 0) cannot step: an "
                                     "earlier step failed"), rank0["again"]
    assert "Restart the job" in rank0["again"]


def test_dead_peer_raises_peer_timeout_everywhere(four_ranks: dict) -> None:
    """Rank 3 (stage 1 of replica 1) dies: its pipeline neighbour notices at once, the ranks
    that meet it (or a failed rank) in an all-reduce within the timeout."""
    for rank, r in enumerate(four_ranks["dies"]):
        assert r["error"] == "PeerTimeoutError", (rank, r)
        assert r["elapsed"] < 3.0 + 2.0
    assert "stage 1 (rank 3)" in four_ranks["dies"][2]["message"]
