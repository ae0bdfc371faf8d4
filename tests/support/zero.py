"""The model, data and eager references of the sharded-optimizer (ZeRO-1) tests.

The float64 tied GPT of ``ckpt_common`` (its auxiliary head and buffer forward never reads
included), a global batch of 12 (D = 1, 2, 3 each get whole micro-batches of 2), and AdamW
with two param groups (no weight decay on vectors), a LambdaLR schedule and gradient
clipping: what ``pipe.optimizer`` must reproduce exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from support.training import ADAM_EPS, CKPT_LR, CONFIG, ckpt_model
from varuna_fx.examples import lm_loss

STEPS = 4
SPLIT = 2  # checkpoint jobs save after SPLIT steps and resume to STEPS
BATCH = 12
MAX_NORM = 0.5
TOL = {"rtol": 1e-9, "atol": 1e-11}


def tokens(seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (STEPS, BATCH, CONFIG.block_size + 1), generator=g)


def param_groups(named: Any) -> list[dict[str, Any]]:
    named = list(named)
    return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]


def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def make_optimizer(named: Any, build: Any = None) -> torch.optim.Optimizer:
    """AdamW over ``named``'s two groups; ``build``: pipe.optimizer (None: torch's own)."""
    groups = param_groups(named)
    if build is None:
        return torch.optim.AdamW(groups, lr=CKPT_LR, eps=ADAM_EPS)
    return build(torch.optim.AdamW, groups, lr=CKPT_LR, eps=ADAM_EPS)


def eager_training(steps: int = STEPS) -> dict[str, torch.Tensor]:
    """``steps`` clipped, scheduled AdamW steps on the whole batch: the reference."""
    model, data = ckpt_model(), tokens()
    opt = make_optimizer(model.named_parameters())
    sched = schedule(opt)
    for step in range(steps):
        opt.zero_grad()
        lm_loss(model(data[step, :, :-1]), data[step, :, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        sched.step()
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


# -- what ordinary training loops do to .grad (issue 30): each must mean what it means in eager
LOOPS = ("torch_clip", "edit", "replace", "opt_zero", "opt_zero_keep")
LOOP_STEPS = 3
EDITED = ("h.0.fc.weight", "h.1.ln1.bias", "ln_f.weight")  # one per stage at P = 2, and a vector


def loop_step(loop: str, named: dict[str, torch.nn.Parameter], opt: torch.optim.Optimizer,
              zero_grad: Any, backward: Any) -> None:
    """One step of a user's loop: ``zero_grad`` is the model's (or pipeline's) own, ``named``
    what this process holds (a pipeline rank edits the gradients it has)."""
    if loop == "opt_zero":
        opt.zero_grad()  # torch's default, set_to_none=True
    elif loop == "opt_zero_keep":
        opt.zero_grad(set_to_none=False)
    else:
        zero_grad()
    backward()
    if loop == "torch_clip":  # torch's own function over what this process holds
        torch.nn.utils.clip_grad_norm_(named.values(), 0.01)
    if loop == "edit":
        for name in EDITED:
            if name in named:
                grad = named[name].grad
                grad.zero_() if name == EDITED[0] else grad.mul_(0.5)
    if loop == "replace":  # a new tensor, not an in-place edit
        for name in EDITED:
            if name in named:
                named[name].grad = named[name].grad * 3.0
    opt.step()


def eager_loop(loop: str) -> dict[str, torch.Tensor]:
    """LOOP_STEPS of ``loop`` with AdamW on the whole batch (no clipping of our own)."""
    model, data = ckpt_model(), tokens()
    opt = make_optimizer(model.named_parameters())
    for step in range(LOOP_STEPS):
        loop_step(loop, dict(model.named_parameters()), opt, model.zero_grad,
                  lambda s=step: lm_loss(model(data[s, :, :-1]), data[s, :, 1:]).backward())
    return {n: t.detach().clone() for n, t in model.state_dict().items()}
