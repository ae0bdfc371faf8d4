"""The tiny GPT, data and eager references the distributed and checkpoint tests share.

Checkpoint tests (``ckpt_*``): the same GPT in float64 (so resumed training can be
compared tightly) with two tensors forward never reads -- an auxiliary head and a
version buffer -- which checkpoints must keep. ``compile_mlp`` / ``step`` / ``weights``: a
small float64 MLP pipeline (P=2) for the checkpoint safety tests, where the model only has
to be real."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig, lm_loss

GLOBAL_BATCH = 8
# Adam divides by sqrt(v) + eps: on gradients that are zero up to rounding (the attention key
# bias) the default eps turns summation-order noise into full-size updates, so two correct
# implementations would disagree; 1e-5 keeps the comparison about the pipeline, not the noise.
ADAM_EPS = 1e-5
STEPS = 3
CONFIG = GPTConfig(vocab_size=96, block_size=12, n_layer=2, n_head=2, n_embd=32)


def make_model_and_data(seed: int = 0, dropout: float = 0.0,
                        dtype: torch.dtype = torch.float32) -> tuple[GPT, torch.Tensor]:
    """A tiny GPT with tied embedding/LM head, and STEPS global batches of tokens."""
    torch.manual_seed(seed)
    model = GPT(dataclasses.replace(CONFIG, dropout=dropout)).to(dtype)
    tokens = torch.randint(0, CONFIG.vocab_size, (STEPS, GLOBAL_BATCH, CONFIG.block_size + 1))
    return model, tokens


def eager_training(max_norm: float = 0.5, precision: str = "fp32",
                   model_dtype: torch.dtype = torch.float32, dropout: float = 0.0) -> dict:
    """What every layout must reproduce: plain training on the whole global batch (with
    dropout, under the pipeline's per-sample keyed draws: ``vf.per_sample_rng``)."""
    model, tokens = make_model_and_data(dtype=model_dtype, dropout=dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=ADAM_EPS)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    losses, norms = [], []
    for step in range(STEPS):
        batch = tokens[step]
        opt.zero_grad()
        keyed = vf.per_sample_rng(GLOBAL_BATCH) if dropout else contextlib.nullcontext()
        with keyed, torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "params": dict(model.named_parameters()),
            "model": model, "tokens": tokens}


def check_against_eager(per_rank: list[dict], eager: dict, P: int, D: int,
                        tol: dict | None = None, autocast: torch.dtype | None = None,
                        outputs: bool = True) -> None:
    tol = tol or {"rtol": 1e-4, "atol": 1e-5}
    assert sorted((r["stage"], r["replica"]) for r in per_rank) == \
        sorted((s, d) for s in range(P) for d in range(D))
    seen: set[str] = set()
    for r in per_rank:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(eager["losses"]),
                                   **tol)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(eager["norms"]),
                                   **tol)
        for name, value in r["params"].items():
            torch.testing.assert_close(value, eager["params"][name].detach(), **tol,
                                       msg=lambda m, n=name, r=r: f"{n} on stage {r['stage']} "
                                       f"replica {r['replica']}: {m}")
            seen.add(name)
        if not outputs:
            continue
        lo, hi = r["rows"]
        with torch.no_grad(), torch.autocast("cpu", autocast, enabled=autocast is not None):
            want = eager["model"](eager["tokens"][0, lo:hi, :-1])
        # pipe(...) on every rank; bf16 logits of size ~8 have an ulp of 0.06
        torch.testing.assert_close(r["logits"], want, **(tol if autocast is None else
                                                         {"rtol": 0.05, "atol": 0.15}))
    assert seen == set(eager["params"]), "every parameter is held by some rank"


# -- checkpoints: an uninterrupted run of CKPT_STEPS; resumed runs stop after CKPT_SPLIT --

CKPT_STEPS = 4  # the uninterrupted run; resumed runs stop after CKPT_SPLIT and continue
CKPT_SPLIT = 2
CKPT_BATCH = 8
CKPT_LR = 1e-2


def ckpt_model(seed: int = 0, dropout: float = 0.0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**CONFIG.__dict__, "dropout": dropout}))
    model.aux_head = nn.Linear(32, 5)  # never called by forward
    model.register_buffer("version", torch.tensor([3.0, 1.0]))  # never read either
    return model.double()


def ckpt_tokens(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (CKPT_STEPS, CKPT_BATCH, CONFIG.block_size + 1), generator=g)


def ckpt_optimizer(params) -> torch.optim.AdamW:  # noqa: ANN001
    return torch.optim.AdamW(params, lr=CKPT_LR, eps=ADAM_EPS, weight_decay=0.1)


def ckpt_eager_training() -> dict[str, torch.Tensor]:
    """CKPT_STEPS AdamW steps on the whole batch: what every resumed layout must reproduce."""
    model, data = ckpt_model(), ckpt_tokens()
    opt = ckpt_optimizer(model.parameters())
    for step in range(CKPT_STEPS):
        opt.zero_grad()
        lm_loss(model(data[step, :, :-1]), data[step, :, 1:]).backward()
        opt.step()
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


CKPT_TOL = {"rtol": 1e-9, "atol": 1e-11}  # float64: only summation order may differ


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
