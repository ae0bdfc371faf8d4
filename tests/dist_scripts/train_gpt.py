"""One rank of a distributed test: trains the tiny tied GPT under each requested layout.

Usage (under tests/support/dist.launch): ``train_gpt.py OUT_DIR JOBS_JSON``. ``JOBS_JSON`` is a
list of jobs run one after another in this process; each writes ``OUT_DIR/<name>_rank<r>.pt``
with the losses, clipped norms and held parameters after the steps, or the error it raised.
Job kinds: ``train`` (compile, 3 AdamW steps with clipping; with ``"reorder": true`` under
Varuna's run-time rule driven by a test predicate, see ``install_late_gradients``), ``bad_world`` (compile for a
layout the world does not have), ``mismatch`` (ranks compile different plans), ``bad_batch`` (steps with wrongly shaped batches), ``peer_loss``
(after compile one rank dies or stalls; the others must raise PeerTimeoutError). A job
that stops the process must be the last one.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import varuna_fx as vf  # noqa: E402
from support.dist import Job, serve_jobs  # noqa: E402
from support.training import ADAM_EPS, CONFIG, GLOBAL_BATCH, make_model_and_data  # noqa: E402
from varuna_fx.examples import (
    GPT,  # noqa: E402
    lm_loss,  # noqa: E402
)
from varuna_fx.schedule import build_schedule  # noqa: E402

RANK = int(os.environ["RANK"])


def compile_job(job: dict[str, Any], share: int) -> vf.Pipeline:
    model, tokens = make_model_and_data(dropout=job.get("dropout", 0.0),
                                        dtype=getattr(torch, job.get("dtype", "float32")))
    micro = job.get("micro_batch_size", {}).get(str(RANK), 2)  # per rank: to disagree
    return vf.compile(model, example_inputs=(tokens[0, :share, :-1],), loss_fn=lm_loss,
                      stages=job["P"], data_parallel=job.get("D"), micro_batch_size=micro,
                      stages_per_rank=job.get("v", 1),
                      schedule=job.get("schedule", "varuna"),
                      recompute=job.get("recompute", "auto"),
                      precision=job.get("precision", "fp32"), timeout=job.get("timeout"))


def install_late_gradients(pipe: vf.Pipeline, steps_done: list[int]) -> None:
    """Drive Varuna's run-time rule on gloo, whose receives cannot be polled: every gradient
    counts as not arrived (so a forward runs ahead wherever the rule allows), and an activation
    as arrived once its sender has sent it this step (senders count their sends in the job's
    store), so a forward run ahead never waits on a peer that waits on this rank."""
    store = torch.distributed.distributed_c10d._get_default_store()
    executor = pipe.runtime.executor

    def sent(msg: Any) -> None:
        if msg.kind == "activation":
            store.add(f"sent/{msg.tag}", 1)

    def arrived(msg: Any) -> bool:
        return msg.kind == "activation" and store.add(f"sent/{msg.tag}", 0) > steps_done[0]

    executor.on_send, executor.arrived = sent, arrived


def train(job: dict[str, Any]) -> dict[str, Any]:
    share = GLOBAL_BATCH // job["D"]
    if job.get("reorder"):  # read when the runtime is built; every rank sets the same
        os.environ["VARUNA_FX_OPPORTUNISTIC_FORWARD"] = "on"
    pipe = compile_job(job, share)
    os.environ.pop("VARUNA_FX_OPPORTUNISTIC_FORWARD", None)
    steps_done = [0]
    if job.get("reorder"):
        install_late_gradients(pipe, steps_done)
    running = pipe.plan.schedule
    if job.get("unit_order"):  # the unit-cost order of the planned kind (same on every rank)
        running = build_schedule(running.name, running.num_stages, running.num_micro_batches,
                                 recompute=running.recompute_stages)
        pipe.runtime.per_stage = running.per_stage
    jumped, held = [], []
    _, tokens = make_model_and_data()
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, eps=ADAM_EPS)
    losses, norms = [], []
    lo = pipe.replica_index * share
    for step in range(tokens.shape[0]):
        batch = tokens[step, lo:lo + share]
        pipe.zero_grad()
        losses.append(float(pipe.step(batch[:, :-1], target=batch[:, 1:])))
        steps_done[0] += 1
        cursor = pipe.runtime.executor.cursor
        jumped.append([str(a) for a in cursor.jumped])
        held.append((cursor.max_live, cursor.peak))
        norms.append(float(pipe.clip_grad_norm_(job.get("max_norm", 0.5))))
        pipe.optimizer_step(opt)
    params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    # which process group carried each message: (kind, peer rank, the group's ranks, group id)
    links = [(m.kind, m.peer_rank, torch.distributed.get_process_group_ranks(m.group)
              if m.group is not None else None, id(m.group))
             for m in pipe.runtime.executor._messages.values()]
    logits = pipe(tokens[0, lo:lo + share, :-1])  # evaluation: every rank gets the output
    result = {"losses": losses, "norms": norms, "params": params, "stage": pipe.stage_index,
              "stages": list(pipe.local_stages),
              "replica": pipe.replica_index, "tied": pipe.plan.tied_parameters,
              "logits": logits, "rows": (lo, lo + share), "jumped": jumped, "held": held,
              "schedule": str(running), "rank": RANK, "links": links}
    pipe.close()
    return result


def bad_batch(job: dict[str, Any]) -> dict[str, Any]:
    share = GLOBAL_BATCH // job["D"]
    pipe = compile_job(job, share)
    _, tokens = make_model_and_data()
    errors = []
    more_rows = torch.cat([tokens[0, :share], tokens[1, :2]])
    for batch in (more_rows, tokens[0, :share, :-2]):  # more rows; shorter rows
        try:
            pipe.step(batch[:, :-1], target=batch[:, 1:])
            errors.append(None)
        except vf.VarunaFxError as exc:
            errors.append((type(exc).__name__, str(exc)))
    ok = tokens[0, :share]  # the run goes on after the error: nothing was sent
    loss = float(pipe.step(ok[:, :-1], target=ok[:, 1:]))
    pipe.close()
    return {"errors": errors, "loss_after": loss}


def accumulate(job: dict[str, Any]) -> dict[str, Any]:
    """Two steps without zero_grad: gradients (tied ones too) must add up as in eager."""
    share = GLOBAL_BATCH // job["D"]
    pipe = compile_job(job, share)
    _, tokens = make_model_and_data()
    lo = pipe.replica_index * share
    for step in range(2):
        batch = tokens[step, lo:lo + share]
        pipe.step(batch[:, :-1], target=batch[:, 1:])
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    pipe.close()
    return {"grads": grads}


def fp16(job: dict[str, Any]) -> dict[str, Any]:
    """A clean fp16 step, then one forced to overflow: every rank must skip it together."""
    share = GLOBAL_BATCH // job["D"]
    pipe = compile_job({**job, "precision": "fp16"}, share)
    _, tokens = make_model_and_data()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    lo = pipe.replica_index * share
    batch = tokens[0, lo:lo + share]
    flags, stepped = [], []
    for scale in (pipe.loss_scale, 2.0**120):  # at 2**120 any fp16 backward overflows
        pipe.runtime.scaler.scale = scale
        pipe.zero_grad()
        loss = float(pipe.step(batch[:, :-1], target=batch[:, 1:]))
        flags.append(pipe.found_inf)
        before = [p.detach().clone() for p in pipe.parameters()]
        stepped.append(pipe.optimizer_step(opt))
        changed = any(not torch.equal(a, p) for a, p in zip(before, pipe.parameters()))
        assert changed == stepped[-1]
    result = {"found_inf": flags, "stepped": stepped, "loss": loss, "scale": pipe.loss_scale}
    pipe.close()
    return result


def peer_loss(job: dict[str, Any]) -> dict[str, Any]:
    pipe = compile_job(job, GLOBAL_BATCH // job["D"])
    _, tokens = make_model_and_data()
    torch.distributed.barrier()  # everyone is through compile's collectives
    if RANK == job.get("dies"):
        os._exit(3)  # a crash: the connection closes under the peers
    if RANK == job.get("stalls"):  # alive but never answering: the others must time out
        time.sleep(job["timeout"] + 2)
        os._exit(0)
    share = GLOBAL_BATCH // job["D"]
    lo = pipe.replica_index * share
    batch = tokens[0, lo:lo + share]
    start = time.monotonic()
    try:
        pipe.step(batch[:, :-1], target=batch[:, 1:])
        outcome: dict[str, Any] = {"error": None}
    except vf.VarunaFxError as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    outcome["elapsed"] = time.monotonic() - start
    if outcome["error"]:  # a user who catches it and steps on: told the group is unusable
        try:
            pipe.step(batch[:, :-1], target=batch[:, 1:])
            outcome["again"] = None
        except vf.VarunaFxError as exc:
            outcome["again"] = f"{type(exc).__name__}: {exc}"
    return outcome


def eval_modes(job: dict[str, Any]) -> dict[str, Any]:
    """torch.export bakes dropout into the graph: eval, then train again, on every rank."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CONFIG, dropout=0.5))
    _, tokens = make_model_and_data()
    batch = tokens[0, :, :-1]
    pipe = vf.compile(model, example_inputs=(batch,), loss_fn=lm_loss, stages=job["P"],
                      micro_batch_size=2, tracer="export")
    pipe.eval()
    evaluated = pipe(batch)
    pipe.train()
    trained = pipe(batch)  # dropout on again: differs from the eval output
    pipe.close()
    return {"eval": evaluated, "train": trained}


def with_rule(kind: Job) -> Job:
    """``kind`` under this rank's run-time rule setting (``rule_env``), without the pipeline a
    job may return."""
    def run(job: dict[str, Any]) -> dict[str, Any]:
        rule = job.get("rule_env", {}).get(str(RANK))
        if rule is not None:
            os.environ["VARUNA_FX_OPPORTUNISTIC_FORWARD"] = rule
        try:
            result = kind(job)
        finally:
            os.environ.pop("VARUNA_FX_OPPORTUNISTIC_FORWARD", None)
        result.pop("pipe", None)
        return result
    return run


if __name__ == "__main__":
    serve_jobs({name: with_rule(kind) for name, kind in {
        "train": train, "bad_batch": bad_batch, "peer_loss": peer_loss, "fp16": fp16,
        "accumulate": accumulate, "eval_modes": eval_modes,
        "bad_world": lambda j: {"pipe": compile_job(j, GLOBAL_BATCH)},
        "mismatch": lambda j: {"pipe": compile_job(j, GLOBAL_BATCH)},
    }.items()})
