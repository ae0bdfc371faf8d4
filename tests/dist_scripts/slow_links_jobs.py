"""One rank of the slow-links tests (issue 31): the float64 tied GPT of tests/support/zero.py.

Usage: ``slow_links_jobs.py OUT_DIR JOBS_JSON``. Each job writes ``OUT_DIR/<name>_rank<r>.pt``;
kinds:

* ``train``: STEPS AdamW steps (``pipe.optimizer``) at (P, D) with the job's ``settings``
  (``compression``, ``sync``: "bf16", ["powersgd", rank], ["diloco", every]); reports the
  losses and the state this rank holds; ``save``: a checkpoint after ``split`` steps.
* ``resume``: loads ``path`` at (P, D, settings) from another initialisation, trains to STEPS.
  ``direct``: then a step of torch's own optimizer over ``pipe.parameters()`` (DiLoCo:
  refused).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import varuna_fx as vf  # noqa: E402
from support.dist import serve_jobs  # noqa: E402
from support.slow_links import compile_settings, run_steps  # noqa: E402
from support.training import ckpt_model  # noqa: E402
from support.zero import BATCH, STEPS, tokens  # noqa: E402
from varuna_fx.examples import lm_loss  # noqa: E402


def compile_job(job: dict[str, Any], seed: int = 0) -> vf.Pipeline:
    share = BATCH // job["D"]
    cluster = vf.Cluster(**job["cluster"]) if "cluster" in job else None
    return vf.compile(ckpt_model(seed=seed), cluster, example_inputs=(tokens()[0, :share, :-1],),
                      loss_fn=lm_loss, stages=job["P"], data_parallel=job["D"],
                      micro_batch_size=2, **compile_settings(job))


def report(pipe: vf.Pipeline, losses: list[float]) -> dict[str, Any]:
    return {"state": {n: t.detach().clone() for n, t in pipe.state_dict().items()},
            "losses": losses, "stage": pipe.stage_index, "replica": pipe.replica_index,
            "compression": pipe.plan.compression, "bounds": pipe.plan.bounds,
            "sync": [str(s) for s in pipe.plan.replica_sync]}


def train(job: dict[str, Any]) -> dict[str, Any]:
    pipe = compile_job(job)
    opt = pipe.optimizer(torch.optim.AdamW, lr=1e-2)
    split = job.get("split", STEPS)
    losses = run_steps(pipe, opt, range(split))
    if job.get("save"):
        pipe.save_checkpoint(job["save"], optimizer=opt, extra={"step": split})
    losses += run_steps(pipe, opt, range(split, STEPS))
    result = report(pipe, losses)
    if job.get("direct"):  # then torch's own optimizer over the parameters: refused?
        result["refused"] = direct_step(pipe)
    pipe.close()
    return result


def resume(job: dict[str, Any]) -> dict[str, Any]:
    pipe = compile_job(job, seed=7)  # another init: everything must come from the checkpoint
    opt = pipe.optimizer(torch.optim.AdamW, lr=1e-2)
    extra = pipe.load_checkpoint(job["path"], optimizer=opt)
    result = report(pipe, run_steps(pipe, opt, range(extra["step"], STEPS)))
    pipe.close()
    return result


def direct_step(pipe: vf.Pipeline) -> str | None:
    """A step of torch's own AdamW over ``pipe.parameters()``: the refusal's text, or None."""
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    data = tokens()
    x, y = pipe.shard((data[0, :, :-1], data[0, :, 1:]))
    pipe.step(x, target=y)
    try:
        opt.step()
    except vf.OptimizerError as exc:
        return str(exc)
    return None


if __name__ == "__main__":
    serve_jobs({"train": train, "resume": resume})
