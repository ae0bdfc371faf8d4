"""What the slow-links tests share (issue 31): settings as JSON and the training loop."""

from __future__ import annotations

from typing import Any

import torch

import varuna_fx as vf
from support.zero import tokens


def compile_settings(job: dict[str, Any]) -> dict[str, Any]:
    """A job's ``compression`` / ``sync`` (JSON: "bf16", ["powersgd", rank],
    ["diloco", every]) as vf.compile's keywords."""
    out: dict[str, Any] = {}
    if "compression" in job:
        out["compression"] = job["compression"]
    sync = job.get("sync")
    if isinstance(sync, list) and sync[0] == "powersgd":
        out["replica_sync"] = vf.PowerSGD(rank=sync[1], start_iter=2)
    elif isinstance(sync, list) and sync[0] == "diloco":
        out["replica_sync"] = vf.DiLoCo(every=sync[1])
    elif sync is not None:
        out["replica_sync"] = sync
    return out


def run_steps(pipe: vf.Pipeline, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    """``steps`` steps on one batch of the ZeRO tests' (each replica its share), learnt
    step after step, so the loss must fall; the losses."""
    data = tokens()
    losses = []
    for _ in steps:
        x, y = pipe.shard((data[0, :, :-1], data[0, :, 1:]))
        pipe.zero_grad()
        losses.append(float(pipe.step(x, target=y)))
        pipe.optimizer_step(opt)
    return losses
