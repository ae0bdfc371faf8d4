"""Registry models with long skips, a block shared by every stage and keyword inputs, and a
float64 model (its loss returned in float64 on the rank without the last stage too), 4 stages
on 2 gloo ranks (v = 2) under every virtual schedule: each rank saves its loss (and its dtype)
and the gradients of the parameters it holds to ``<out>/rank<r>.pt``.
Used by tests/test_virtual_distributed.py::test_registry_models_on_two_ranks_match_eager."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import varuna_fx as vf  # noqa: E402
from support.eager import call_args  # noqa: E402
from support.registry import CASES, as_float64  # noqa: E402

MODELS = ("unet_skips", "albert_shared", "kwargs_dict", "mlp64")
CASES = {**CASES, "mlp64": as_float64(CASES["mlp"])}
SCHEDULES = ("interleaved-1f1b", "zbv", "dualpipev")

out = Path(sys.argv[1])
results = {}
for name in MODELS:
    for schedule in SCHEDULES:
        case = CASES[name]
        # a distributed compile empties what this rank does not hold: a fresh copy each
        pipe = vf.compile(copy.deepcopy(case.model), example_inputs=case.inputs, loss_fn=case.loss_fn,
                          stages=4, stages_per_rank=2, schedule=schedule, recompute=True,
                          micro_batch_size=case.batch_size // 4)
        args, kwargs = call_args(case)
        pipe.zero_grad()
        loss = pipe.step(*args, target=case.target, **kwargs)
        results[f"{name}-{schedule}"] = {
            "loss": float(loss), "dtype": loss.dtype, "stages": list(pipe.local_stages),
            "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()
                      if p.grad is not None}}
        pipe.close()
torch.save(results, out / f"rank{dist.get_rank()}.pt")
