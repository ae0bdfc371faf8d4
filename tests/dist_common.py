"""The model and data every distributed test rank and its eager reference share."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

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
