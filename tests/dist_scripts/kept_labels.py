"""A loss that is a mean over the labels each micro-batch keeps, on 2 gloo ranks (P = 2):
each rank saves its losses and gradients to ``<out>/rank<r>.pt``.
Used by tests/capture/test_hf_models.py::test_mean_over_kept_labels_on_two_ranks_matches_eager."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import varuna_fx as vf  # noqa: E402
from support import label_models as t  # noqa: E402

out = Path(sys.argv[1])
torch.manual_seed(0)
model, (ids, labels) = t.TokenLM(), t.kept_labels_batch()
pipe = vf.compile(model, example_inputs={"input_ids": ids, "labels": labels}, stages=2,
                  data_parallel=1, micro_batch_size=2)
losses = []
for _ in range(2):
    pipe.zero_grad()
    losses.append(float(pipe.step(input_ids=ids, labels=labels)))
torch.save({"losses": losses,
            "grads": {k: p.grad.clone() for k, p in pipe.named_parameters()}},
           out / f"rank{dist.get_rank()}.pt")
pipe.close()
