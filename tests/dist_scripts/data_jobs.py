"""One rank of the data-position test: a tiny GPT fed by ``pipe.data_loader`` with sample ids.

Usage: ``data_jobs.py OUT_DIR JOB_JSON`` (under tests/support/dist.launch). The job: ``P``,
``D``, ``steps`` (the global steps to reach), ``load`` (a checkpoint to resume from, or none),
``save_at``/``save`` (save after that step), ``monitor`` (a vf.Monitor under OUT_DIR/run).
Writes ``OUT_DIR/<name>_rank<r>.json``: this rank's stage and replica, and per step run the
sample ids it stepped on, the loss and the learning rate.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import varuna_fx as vf  # noqa: E402
from support.data_job import GLOBAL, build, train  # noqa: E402

RANK = int(os.environ["RANK"])


def main(out: Path, job: dict[str, Any]) -> None:
    pipe, loader, opt, sched = build(job["P"], job["D"])
    monitor = vf.Monitor(pipe, out / "run", live=False, memory_every=2) \
        if job.get("monitor") else None
    done = 0
    if job.get("load"):
        pipe.load_checkpoint(job["load"], opt, data=loader, scheduler=sched)
        done = loader.state_dict()["global_batches"]
    steps = []
    for step in range(done, job["steps"]):
        steps.append(train(pipe, loader, opt, sched))
        if monitor is not None:
            monitor.log(steps[-1]["loss"], lr=steps[-1]["lr"])
        if step + 1 == job.get("save_at"):
            pipe.save_checkpoint(job["save"], opt, data=loader, scheduler=sched)
    if monitor is not None:
        monitor.close()
    assert loader.global_batch_size == GLOBAL
    result = {"stage": pipe.stage_index, "replica": pipe.replica_index, "steps": steps}
    (out / f"{job['name']}_rank{RANK}.json").write_text(json.dumps(result))
    pipe.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
