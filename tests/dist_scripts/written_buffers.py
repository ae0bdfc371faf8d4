"""Models whose forward writes buffers, trained three steps on 3 gloo ranks (P = 3); each
rank saves its losses, state and gradients to ``<out>/rank<r>.pt``.
Used by tests/capture/test_written_buffers.py::test_written_buffers_on_three_ranks_match_eager."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import varuna_fx as vf  # noqa: E402
from support import stateful_models as t  # noqa: E402

out = Path(sys.argv[1])
results = {}
for name, tracer in t.WRITTEN_BUFFER_JOBS:
    torch.manual_seed(0)
    model, x = t.WRITTEN_BUFFER_MODELS[name](), torch.randn(8, 8)
    pipe = vf.compile(model, example_inputs=(x,), stages=3, data_parallel=1, micro_batch_size=8,
                      tracer=tracer)
    losses = []
    for _ in range(3):
        pipe.zero_grad()
        losses.append(float(pipe.step(x)))
    results[f"{name}-{tracer}"] = {
        "losses": losses, "state": {k: v.clone() for k, v in pipe.state_dict().items()},
        "grads": {k: p.grad.clone() for k, p in pipe.named_parameters() if p.grad is not None}}
    pipe.close()
torch.save(results, out / f"rank{dist.get_rank()}.pt")
