"""The data position on gloo ranks: P=2 x D=2 steps on the global order, saves at step 3 and
goes on; P=1 x D=3 and one process (D=1) resume from that checkpoint and step on the same
samples, with the same learning rates and losses, as the uninterrupted run. The monitor runs
on the four ranks: rank 0 alone writes, with every rank's memory and timeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support.data_job import build, expected_global_batches, train
from support.dist import launch_ok

SAVE_AT, STEPS = 3, 6


def per_step_global(tmp_path: Path, name: str, ranks: int) -> list[list[int]]:
    """Each step's global batch as the ranks stepped on it: the replicas' shares in replica
    order (every rank of a replica stepped on the same share)."""
    results = [json.loads((tmp_path / f"{name}_rank{r}.json").read_text()) for r in range(ranks)]
    shares: dict[int, list[list[int]]] = {}
    for r in results:
        ids = [s["ids"] for s in r["steps"]]
        assert shares.setdefault(r["replica"], ids) == ids
    return [sum((shares[d][k] for d in sorted(shares)), []) for k in range(len(results[0]["steps"]))]


def losses(tmp_path: Path, name: str) -> tuple[list[float], list[float]]:
    r = json.loads((tmp_path / f"{name}_rank0.json").read_text())
    return [s["loss"] for s in r["steps"]], [s["lr"] for s in r["steps"]]


@pytest.mark.slow
@pytest.mark.distributed
def test_any_layout_resumes_on_the_samples_an_uninterrupted_run_sees(tmp_path: Path) -> None:
    expected = expected_global_batches(STEPS)
    ckpt = str(tmp_path / "ckpt")
    launch_ok("data_jobs.py", 4, [str(tmp_path), json.dumps(
        {"name": "p2d2", "P": 2, "D": 2, "steps": STEPS, "save_at": SAVE_AT, "save": ckpt,
         "monitor": True})], timeout=240)
    assert per_step_global(tmp_path, "p2d2", 4) == expected
    launch_ok("data_jobs.py", 3, [str(tmp_path), json.dumps(
        {"name": "p1d3", "P": 1, "D": 3, "steps": STEPS, "load": ckpt})], timeout=240)
    assert per_step_global(tmp_path, "p1d3", 3) == expected[SAVE_AT:]

    pipe, loader, opt, sched = build(2, 1)  # one process
    pipe.load_checkpoint(ckpt, opt, data=loader, scheduler=sched)
    one = [train(pipe, loader, opt, sched) for _ in range(STEPS - SAVE_AT)]
    assert [s["ids"] for s in one] == expected[SAVE_AT:]

    loss, lr = losses(tmp_path, "p2d2")
    loss3, lr3 = losses(tmp_path, "p1d3")
    assert lr[SAVE_AT:] == lr3 == [s["lr"] for s in one]
    for other in (loss3, [s["loss"] for s in one]):
        torch.testing.assert_close(torch.tensor(other), torch.tensor(loss[SAVE_AT:]),
                                   rtol=1e-4, atol=1e-5)

    run = tmp_path / "run"  # the monitor: rank 0 wrote, gathering every rank
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["bytes_sent"] > 0 and r["samples"] == 12 and r["tokens_per_second"] > 0
               for r in records)
    assert len(records[1]["peak_memory_per_rank"]) == 4
    assert all(b > 0 for b in records[-1]["bytes_sent_per_rank"])
    assert (run / "charts" / "timeline.png").stat().st_size > 10_000
    assert (run / "charts" / "training.png").stat().st_size > 10_000
