"""The model, data and eager reference the checkpoint tests share (one process and ranks).

``compile_mlp`` / ``step``: a small float64 MLP pipeline (P=2) for tests of the checkpoint's
safety, where the model only has to be real, not a GPT.

A tiny tied GPT in float64 (so resumed training can be compared tightly) with two tensors
forward never reads -- an auxiliary head and a version buffer -- which checkpoints must keep.
"""

from __future__ import annotations

import torch
from torch import nn

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig, lm_loss

STEPS = 4  # the uninterrupted run; resumed runs stop after SPLIT and continue
SPLIT = 2
BATCH = 8
LR = 1e-2
EPS = 1e-5  # see dist_common.ADAM_EPS
CONFIG = GPTConfig(vocab_size=96, block_size=12, n_layer=2, n_head=2, n_embd=32)


def make_model(seed: int = 0, dropout: float = 0.0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**CONFIG.__dict__, "dropout": dropout}))
    model.aux_head = nn.Linear(32, 5)  # never called by forward
    model.register_buffer("version", torch.tensor([3.0, 1.0]))  # never read either
    return model.double()


def tokens(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (STEPS, BATCH, CONFIG.block_size + 1), generator=g)


def optimizer(params) -> torch.optim.AdamW:  # noqa: ANN001
    return torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=0.1)


def eager_training() -> dict[str, torch.Tensor]:
    """STEPS AdamW steps on the whole batch: what every resumed layout must reproduce."""
    model, data = make_model(), tokens()
    opt = optimizer(model.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        lm_loss(model(data[step, :, :-1]), data[step, :, 1:]).backward()
        opt.step()
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


TOL = {"rtol": 1e-9, "atol": 1e-11}  # float64: only summation order may differ


def compile_mlp(seed: int = 0, stages: int = 2) -> vf.Pipeline:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4)).double()
    return vf.compile(model, example_inputs=(torch.randn(4, 8, dtype=torch.float64),),
                      loss_fn=nn.functional.mse_loss, stages=stages, micro_batch_size=2)


def step(pipe: vf.Pipeline, opt: torch.optim.Optimizer | None = None) -> float:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 8, dtype=torch.float64, generator=g)
    pipe.zero_grad()
    loss = float(pipe.step(x, target=torch.zeros(4, 4, dtype=torch.float64)))
    if opt is not None:
        opt.step()
    return loss


def weights(pipe: vf.Pipeline) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in pipe.state_dict().items()}
