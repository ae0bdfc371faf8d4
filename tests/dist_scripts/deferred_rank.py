"""One rank of a deferred-init test: compile a vf.deferred_init GPT, report what it holds.

Usage: ``deferred_rank.py OUT_DIR P [meta | resume CHECKPOINT]`` (D = world size / P; every replica steps on the
same batch, so the averaged gradients are eager's on it). Writes ``OUT_DIR/rank<r>.pt``: the state this
rank holds, which model tensors are real and how many are still on the meta device, its parameters' gradients
after one SGD step's backward, and the loss; then the same for every model of the zoo on 2
ranks, the masked nanoGPT alone on more (``OUT_DIR/zoo-<name>-<r>.pt``: loss and gradients). ``meta``: the model is put on the meta device
without deferred_init (compile must refuse it with a VarunaFxError, which is written).
``resume``: built under deferred_init and skip_init, a step before the load (must raise), then
the checkpoint loaded and one step: the loss and the state it holds.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import varuna_fx as vf  # noqa: E402
from support.deferred import CFG, SEED, batch, deferred_gpt  # noqa: E402
from support.real_zoo import ZOO  # noqa: E402
from varuna_fx.capture.buffers import MicroBatchStateWarning  # noqa: E402
from varuna_fx.examples import GPT, lm_loss  # noqa: E402

RANK = int(os.environ["RANK"])
OUT = Path(sys.argv[1])
P = int(sys.argv[2])

x, y = batch()
if sys.argv[3:] == ["meta"]:
    with torch.device("meta"):
        model = GPT(CFG)
    try:
        vf.compile(model, example_inputs=(x,), loss_fn=lm_loss, stages=P)
        outcome = "compiled"
    except vf.VarunaFxError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    torch.save({"error": outcome}, OUT / f"rank{RANK}.pt")
    sys.exit(0)

if sys.argv[3:4] == ["resume"]:  # deferred + skip_init, then the checkpoint at argv[4]
    with vf.deferred_init(seed=SEED), vf.skip_init():
        model = GPT(CFG).double()
    pipe = vf.compile(model, example_inputs=(x,), loss_fn=lm_loss, stages=P)
    try:
        pipe.step(x, target=y)
        before = "stepped"
    except vf.UninitializedError as exc:
        before = str(exc)
    pipe.load_checkpoint(sys.argv[4])
    torch.save({"before": before, "loss": float(pipe.step(x, target=y)),
                "state": {k: v.detach().clone() for k, v in pipe.state_dict().items()}},
               OUT / f"rank{RANK}.pt")
    pipe.close()
    sys.exit(0)

model = deferred_gpt()
pipe = vf.compile(model, example_inputs=(x,), loss_fn=lm_loss, stages=P,
                  data_parallel=int(os.environ["WORLD_SIZE"]) // P)
state = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
real = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if not t.is_meta]
meta = sum(t.is_meta for t in [*model.parameters(), *model.buffers()])
loss = pipe.step(x, target=y)
grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
torch.save({"state": state, "meta": meta, "real": real, "held": pipe._held_names(), "loss": float(loss), "grads": grads,
            "stage": pipe.stage_index}, OUT / f"rank{RANK}.pt")

# the zoo of real code (tests/support/real_zoo.py: nanoGPT's own loss from targets, x[:, [-1]],
# tied heads, RoPE, MoE routing, scans, a ViT) on the same ranks: every model on 2 ranks, the
# masked nanoGPT alone on more (its D = 2 replicas)
names = list(ZOO) if int(os.environ["WORLD_SIZE"]) == 2 else ["nanogpt-masked"]
for name in names:
    entry = ZOO[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MicroBatchStateWarning)  # means of equal counts
        with vf.deferred_init(seed=SEED):
            zoo = entry.build()
        zoo_pipe = vf.compile(zoo, example_inputs=entry.inputs, loss_fn=entry.loss_fn, stages=P,
                              data_parallel=int(os.environ["WORLD_SIZE"]) // P,
                              micro_batch_size=2)
    target = {} if entry.target is None else {"target": entry.target}
    zoo_loss = zoo_pipe.step(*entry.inputs, **target)
    torch.save({"loss": float(zoo_loss),
                "grads": {n: p.grad.clone() for n, p in zoo_pipe.named_parameters()
                          if p.grad is not None}},
               OUT / f"zoo-{name}-{RANK}.pt")
    zoo_pipe.close()
pipe.close()
pipe.close()
