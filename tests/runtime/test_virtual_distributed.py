"""Virtual stages on gloo ranks: 4 stages on 2 ranks (v = 2), against eager training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.dist import launch_ok, run_jobs
from support.training import check_against_eager, eager_training

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

JOBS = [("interleaved-1f1b", False), ("interleaved-1f1b", True), ("zbv", False), ("zbv", True),
        ("dualpipev", True)]


@pytest.fixture(scope="module")
def eager() -> dict:
    return eager_training()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    jobs = [{"name": f"{s}_r{int(rc)}", "kind": "train", "P": 4, "v": 2, "D": 1,
             "schedule": s, "recompute": rc} for s, rc in JOBS]
    return run_jobs(tmp_path_factory.mktemp("virtual"), 2, jobs, timeout=300.0)


@pytest.mark.parametrize("schedule,recompute", JOBS)
def test_four_stages_on_two_ranks_match_eager(two_ranks: dict, eager: dict, schedule: str,
                                              recompute: bool) -> None:
    per_rank = two_ranks[f"{schedule}_r{int(recompute)}"]
    # losses, clipped norms, every parameter after 3 AdamW steps, and pipe(...)'s output
    check_against_eager([{**r, "stage": r["rank"]} for r in per_rank], eager, 2, 1)
    held = {r["rank"]: r["stages"] for r in per_rank}
    assert held == ({0: [0, 2], 1: [1, 3]} if schedule == "interleaved-1f1b" else
                    {0: [0, 3], 1: [1, 2]})
    # messages only between ranks: V-shape's stage 1 -> 2 stays on rank 1
    for r in per_rank:
        assert all(peer != r["rank"] for _kind, peer, _ranks, _gid in r["links"])
    if schedule != "interleaved-1f1b":  # V shape: the tied embedding and head both on rank 0
        assert per_rank[0]["tied"] and all(
            set(h) == {0, 3} for h in per_rank[0]["tied"].values())


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    jobs = [{"name": "zbv_D2", "kind": "train", "P": 4, "v": 2, "D": 2, "schedule": "zbv",
             "recompute": False}]
    return run_jobs(tmp_path_factory.mktemp("virtual4"), 4, jobs, timeout=300.0)


def test_two_replicas_of_two_ranks_match_eager(four_ranks: dict, eager: dict) -> None:
    """P = 4 on 2 ranks x D = 2: the data-parallel group is a rank's (both its stages), the
    tied embedding and head (both on rank 0 of each replica) average over the replicas only."""
    per_rank = four_ranks["zbv_D2"]
    check_against_eager([{**r, "stage": r["rank"] % 2} for r in per_rank], eager, 2, 2)
    assert {r["rank"]: (r["stages"], r["replica"]) for r in per_rank} == {
        0: ([0, 3], 0), 1: ([1, 2], 0), 2: ([0, 3], 1), 3: ([1, 2], 1)}


def test_registry_models_on_two_ranks_match_eager(tmp_path: Path) -> None:
    """Long skips (a value two local stages receive from one remote stage), a block every
    stage shares, keyword inputs; recompute on; loss and every held gradient as eager. A
    float64 model's loss is float64 on both ranks (interleaved: the last stage is rank 1's,
    zbv and dualpipev: rank 0's), not rounded to float32 on the other."""
    from support.eager import eager_grads
    from support.registry import CASES, as_float64

    cases = {**CASES, "mlp64": as_float64(CASES["mlp"])}

    launch_ok("virtual_registry.py", 2, [str(tmp_path)], timeout=300.0)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for key in ranks[0]:
        loss, grads = eager_grads(cases[key.split("-")[0]])
        exact = {"rtol": 1e-13, "atol": 0.0} if loss.dtype == torch.float64 else {}
        seen: set[str] = set()
        for r in ranks:
            assert r[key]["dtype"] == loss.dtype, (key, r[key]["dtype"])
            torch.testing.assert_close(torch.tensor(r[key]["loss"], dtype=loss.dtype), loss,
                                       **exact)
            for n, g in r[key]["grads"].items():
                torch.testing.assert_close(g, grads[n], msg=lambda m, n=n, k=key: f"{k} {n}: {m}")
                seen.add(n)
        assert seen == set(grads), f"{key}: every gradient is held by some rank"
