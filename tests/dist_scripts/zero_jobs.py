"""One rank of the sharded-optimizer (ZeRO-1) tests: the float64 tied GPT of tests/support/zero.py.

Usage: ``zero_jobs.py OUT_DIR JOBS_JSON``. Each job writes ``OUT_DIR/<name>_rank<r>.pt``; kinds:

* ``train``: STEPS clipped, scheduled AdamW steps at (P, D) with ``pipe.optimizer``; reports the
  state this rank holds, its optimizer state bytes, and whether the optimizer is sharded.
  ``compiled``: its stages through torch.compile / inductor (``compile_stages="on"``).
  ``save``: also saves after SPLIT steps to ``path``.
* ``resume``: loads ``path`` at (P, D, shard) with ``pipe.optimizer`` (or torch's own when
  ``direct``), trains to STEPS, reports the state.
* ``refusals``: the errors: a non-elementwise optimizer, a direct optimizer under
  shard_optimizer=True, a replaced optimizer, a tensor that is not a parameter.
* ``precision``: bf16 and fp16 steps sharded and unsharded (each with clipping): equal.
* ``accumulate``: gradients of two ``pipe.step`` calls per optimizer step, sharded and not.
* ``loops``: what training loops do to ``.grad`` (support/zero.py ``LOOPS``: torch's
  clip_grad_norm_, in-place edits, replaced gradients, ``opt.zero_grad()``), sharded and not;
  and the refusal of a gradient set to None beside others of its flat slice.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import varuna_fx as vf  # noqa: E402
from support.dist import serve_jobs  # noqa: E402
from support.training import ckpt_model  # noqa: E402
from support.zero import (  # noqa: E402
    BATCH,
    LOOP_STEPS,
    LOOPS,
    MAX_NORM,
    SPLIT,
    STEPS,
    loop_step,
    make_optimizer,
    schedule,
    tokens,
)
from varuna_fx.examples import lm_loss  # noqa: E402
from varuna_fx.runtime.sync.zero import layout_of, shard_state_bytes  # noqa: E402

RANK = int(os.environ["RANK"])
OUT = Path(sys.argv[1])


def compile_job(job: dict[str, Any], seed: int = 0, **kw: Any) -> vf.Pipeline:
    share = BATCH // job["D"]
    if job.get("compiled"):  # the stages through inductor, the first step waiting for it
        kw = {**kw, "compile_stages": "on", "compile_wait": True}
    return vf.compile(ckpt_model(seed=seed), example_inputs=(tokens()[0, :share, :-1],),
                      loss_fn=lm_loss, stages=job["P"], data_parallel=job["D"],
                      micro_batch_size=2, shard_optimizer=job.get("shard", True), **kw)


def run_steps(pipe: vf.Pipeline, opt: torch.optim.Optimizer, sched: Any, steps: range) -> None:
    data = tokens()
    for step in steps:
        x, y = pipe.shard((data[step, :, :-1], data[step, :, 1:]))
        pipe.zero_grad()
        pipe.step(x, target=y)
        pipe.clip_grad_norm_(MAX_NORM)
        pipe.optimizer_step(opt)
        sched.step()


def report(pipe: vf.Pipeline, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"state": {n: t.detach().clone() for n, t in pipe.state_dict().items()},
            "stage": pipe.stage_index, "replica": pipe.replica_index,
            "sharded": layout_of(opt) is not None, "state_bytes": shard_state_bytes(opt),
            "stage_params": sum(p.numel() * p.element_size() for p in pipe.parameters()
                                if p.requires_grad)}


def train(job: dict[str, Any]) -> dict[str, Any]:
    pipe = compile_job(job)
    opt = make_optimizer(pipe.named_parameters(), pipe.optimizer)
    assert isinstance(opt, torch.optim.AdamW)
    sched = schedule(opt)
    run_steps(pipe, opt, sched, range(SPLIT))
    if job.get("path"):
        pipe.save_checkpoint(job["path"], optimizer=opt,
                             extra={"step": SPLIT, "sched": sched.state_dict()})
    run_steps(pipe, opt, sched, range(SPLIT, STEPS))
    result = report(pipe, opt)
    result["shard_keys"] = len(opt.state_dict()["state"])
    pipe.close()
    return result


def resume(job: dict[str, Any]) -> dict[str, Any]:
    pipe = compile_job(job, seed=7)  # another init: everything must come from the checkpoint
    build = None if job.get("direct") else pipe.optimizer
    opt = make_optimizer(pipe.named_parameters(), build)
    sched = schedule(opt)
    extra = pipe.load_checkpoint(job["path"], optimizer=opt)
    sched.load_state_dict(extra["sched"])
    run_steps(pipe, opt, sched, range(extra["step"], STEPS))
    result = report(pipe, opt)
    pipe.close()
    return result


def refusals(job: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = {}

    def attempt(name: str, fn: Any) -> None:
        try:
            fn()
            found[name] = None
        except vf.VarunaFxError as exc:
            found[name] = (type(exc).__name__, str(exc))

    pipe = compile_job(job)
    data = tokens()
    x, y = pipe.shard((data[0, :, :-1], data[0, :, 1:]))
    attempt("lbfgs", lambda: pipe.optimizer(torch.optim.LBFGS, lr=1.0))
    attempt("not_a_parameter", lambda: pipe.optimizer(torch.optim.SGD, [torch.zeros(3)], lr=1.0))
    direct = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    pipe.step(x, target=y)
    attempt("direct", direct.step)
    first = pipe.optimizer(torch.optim.SGD, lr=0.1)
    second = pipe.optimizer(torch.optim.SGD, lr=0.1)
    attempt("replaced", first.step)
    attempt("newest", second.step)
    pipe.close()
    return found


def precision(job: dict[str, Any]) -> dict[str, Any]:
    """bf16 and fp16 (loss scaling): sharded == unsharded after two clipped steps."""
    out: dict[str, Any] = {}
    for prec in ("bf16", "fp16"):
        for shard in (True, False):
            pipe = compile_job({**job, "shard": shard}, precision=prec)
            opt = make_optimizer(pipe.named_parameters(), pipe.optimizer)
            sched = schedule(opt)
            run_steps(pipe, opt, sched, range(2))
            out[(prec, shard)] = {n: t.detach().clone() for n, t in pipe.state_dict().items()}
            out[(prec, shard, "scale")] = pipe.loss_scale
            pipe.close()
    return out


def accumulate(job: dict[str, Any]) -> dict[str, Any]:
    """Two batches' gradients per optimizer step (no zero_grad between): sharded == plain."""
    out: dict[str, Any] = {}
    data = tokens()
    for shard in (True, False):
        pipe = compile_job({**job, "shard": shard})
        opt = make_optimizer(pipe.named_parameters(), pipe.optimizer)
        for step in range(0, 4, 2):
            pipe.zero_grad()
            for k in (step, step + 1):
                x, y = pipe.shard((data[k, :, :-1], data[k, :, 1:]))
                pipe.step(x, target=y)
            pipe.clip_grad_norm_(MAX_NORM)
            pipe.optimizer_step(opt)
        out[shard] = {n: t.detach().clone() for n, t in pipe.state_dict().items()}
        pipe.close()
    return out


def loops(job: dict[str, Any]) -> dict[str, Any]:
    out: dict[Any, Any] = {}
    data = tokens()
    for shard in (True, False):
        pipe = compile_job({**job, "shard": shard})
        initial = {n: t.detach().clone() for n, t in pipe.state_dict().items()}
        for loop in LOOPS:
            pipe.load_state_dict(initial)
            opt = make_optimizer(pipe.named_parameters(), pipe.optimizer)
            pipe.zero_grad()
            for step in range(LOOP_STEPS):
                x, y = pipe.shard((data[step, :, :-1], data[step, :, 1:]))
                loop_step(loop, dict(pipe.named_parameters()), opt, pipe.zero_grad,
                          lambda x=x, y=y, pipe=pipe: pipe.step(x, target=y))
            out[(loop, shard)] = {n: t.detach().clone() for n, t in pipe.state_dict().items()}
        if shard:  # one gradient of a flat slice set to None: refused on every rank
            opt = pipe.optimizer(torch.optim.SGD, lr=0.1)
            x, y = pipe.shard((data[0, :, :-1], data[0, :, 1:]))
            pipe.step(x, target=y)
            named = dict(pipe.named_parameters())
            dropped = next(n for n in ("h.0.fc.weight", "h.1.fc.weight") if n in named)
            named[dropped].grad = None
            try:
                opt.step()
                out["none"] = None
            except vf.OptimizerError as exc:
                out["none"] = str(exc)
        pipe.close()
    return out


if __name__ == "__main__":
    serve_jobs({"train": train, "resume": resume, "refusals": refusals, "precision": precision,
                "accumulate": accumulate, "loops": loops})
