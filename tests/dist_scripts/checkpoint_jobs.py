"""One rank of a checkpoint test (float64 GPT of tests/support/training.py).

Usage: ``checkpoint_jobs.py OUT_DIR JOBS_JSON`` (under tests/support/dist.launch or torchrun).
Each job writes ``OUT_DIR/<name>_rank<r>.pt``. Kinds:

* ``save``: CKPT_SPLIT steps from scratch at (P, D), then save to ``path`` (``async``: while one more
  step runs; that step is not saved).
* ``resume``: load ``path`` at (P, D, micro-batch size, schedule), train to CKPT_STEPS; reports the
  state this rank holds and how many parameters have optimizer state.
* ``forgot``: built under ``vf.skip_init`` and stepped without loading (every rank must raise).
* ``paths``: every rank saves to, then loads from, a path of its own (a timestamp in the name):
  every rank must raise, and nothing may be written; then the same path works.
* ``preempt``: the preemption-safe loop of docs/checkpoints.md (save every ``every`` steps and on
  preemption); writes its pid and progress so the test can signal it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import varuna_fx as vf  # noqa: E402
from support.dist import serve_jobs  # noqa: E402
from support.training import (  # noqa: E402
    CKPT_BATCH,
    CKPT_SPLIT,
    CKPT_STEPS,
    ckpt_model,
    ckpt_optimizer,
    ckpt_tokens,
)
from varuna_fx.examples import lm_loss  # noqa: E402

RANK = int(os.environ["RANK"])
OUT = Path(sys.argv[1])


def compile_job(job: dict[str, Any]) -> vf.Pipeline:
    share = CKPT_BATCH // job["D"]
    with vf.skip_init(enabled=job.get("skip_init", False)):  # a resuming job need not init
        model = ckpt_model(seed=job.get("seed", 0))
    return vf.compile(model,
                      example_inputs=(ckpt_tokens()[0, :share, :-1],), loss_fn=lm_loss,
                      stages=job["P"], data_parallel=job["D"],
                      micro_batch_size=job.get("micro", 2),
                      schedule=job.get("schedule", "varuna"))


def run_steps(pipe: vf.Pipeline, opt: torch.optim.Optimizer, steps: range) -> None:
    data = ckpt_tokens()
    share = CKPT_BATCH // pipe.plan.data_parallel
    lo = pipe.replica_index * share
    for step in steps:
        batch = data[step % CKPT_STEPS, lo:lo + share]
        pipe.zero_grad()
        pipe.step(batch[:, :-1], target=batch[:, 1:])
        opt.step()


def save(job: dict[str, Any]) -> dict[str, Any]:
    pipe = compile_job(job)
    opt = ckpt_optimizer(pipe.parameters())
    run_steps(pipe, opt, range(CKPT_SPLIT))
    try:  # a bad extra is seen on rank 0 only: every rank must raise, none may hang
        pipe.save_checkpoint(job["path"] + "_bad", extra={"f": object()})
        bad = None
    except vf.VarunaFxError as exc:
        bad = (type(exc).__name__, str(exc))
    if job.get("async"):
        handle = pipe.save_checkpoint(job["path"], optimizer=opt, extra={"step": CKPT_SPLIT},
                                      async_save=True)
        run_steps(pipe, opt, range(CKPT_SPLIT, CKPT_SPLIT + 1))  # while the shards are written
        handle.result()
    else:
        pipe.save_checkpoint(job["path"], optimizer=opt, extra={"step": CKPT_SPLIT})
    try:  # the user's model object holds only this rank's stage: saving it must not work
        pipe.model.state_dict()
        whole_model = None
    except vf.VarunaFxError as exc:
        whole_model = (type(exc).__name__, str(exc))
    pipe.close()
    return {"stage": pipe.stage_index, "bad_extra": bad, "model_state_dict": whole_model}


def resume(job: dict[str, Any]) -> dict[str, Any]:
    pipe = compile_job({**job, "seed": 7})  # another init: all must come from the checkpoint
    opt = ckpt_optimizer(pipe.parameters())
    try:
        extra = pipe.load_checkpoint(job["path"], optimizer=opt)
    except vf.VarunaFxError:
        pipe.close()  # the next job starts from a clean slate
        raise
    with_state = sum(1 for p in pipe.parameters() if p in opt.state)
    run_steps(pipe, opt, range(extra["step"], CKPT_STEPS))
    state = {n: t.detach().clone() for n, t in pipe.state_dict().items()}
    pipe.close()
    return {"state": state, "stage": pipe.stage_index, "replica": pipe.replica_index,
            "with_state": with_state, "extra": extra}


def forgot(job: dict[str, Any]) -> dict[str, Any]:
    pipe = compile_job({**job, "skip_init": True})
    run_steps(pipe, ckpt_optimizer(pipe.parameters()), range(1))  # raises: nothing was loaded
    return {"stepped": True}


def paths(job: dict[str, Any]) -> dict[str, Any]:
    pipe = compile_job(job)
    opt = ckpt_optimizer(pipe.parameters())
    run_steps(pipe, opt, range(1))
    errors = {}
    own = f"{job['path']}_{RANK}_{time.time_ns()}"
    for call in ("save", "load"):
        try:
            if call == "save":
                pipe.save_checkpoint(own, optimizer=opt, extra={"step": 1})
            else:
                pipe.load_checkpoint(f"{job['path']}_good{RANK}", optimizer=opt)
            errors[call] = None
        except vf.VarunaFxError as exc:
            errors[call] = (type(exc).__name__, str(exc))
        if call == "save":  # one good checkpoint per rank-specific path, for the load
            for r in range(2):
                pipe.save_checkpoint(f"{job['path']}_good{r}", optimizer=opt,
                                     extra={"step": r})
    pipe.close()
    return {"errors": errors, "written": sorted(os.listdir(Path(job["path"]).parent))}


def preempt(job: dict[str, Any]) -> dict[str, Any]:
    pipe = compile_job(job)
    opt = ckpt_optimizer(pipe.parameters())
    (OUT / f"pid{RANK}").write_text(str(os.getpid()))
    start = vf.latest_checkpoint(job["dir"])
    step = pipe.load_checkpoint(start, optimizer=opt)["step"] if start else 0
    while step < job["total"]:
        run_steps(pipe, opt, range(step, step + 1))
        step += 1
        (OUT / f"progress{RANK}").write_text(str(step))
        if pipe.preempted or step % job["every"] == 0:
            pipe.save_checkpoint(f"{job['dir']}/step{step:08d}", optimizer=opt,
                                 extra={"step": step})
        if pipe.preempted:
            break
    return {"stopped_at": step, "preempted": pipe.preempted, "time": time.time()}


if __name__ == "__main__":
    serve_jobs({"save": save, "resume": resume, "preempt": preempt, "forgot": forgot,
                "paths": paths})
