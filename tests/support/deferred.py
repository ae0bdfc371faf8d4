"""Models shared by the deferred-init tests and their multi-process script."""

from __future__ import annotations

import torch

import varuna_fx as vf
from varuna_fx.examples import GPT, GPTConfig

SEED = 7
CFG = GPTConfig(n_layer=4, n_embd=32, n_head=4, vocab_size=200, block_size=16)


def deferred_gpt(seed: int = SEED, dtype: torch.dtype = torch.float64) -> GPT:
    """The example GPT (tied head, causal-mask buffers) built under vf.deferred_init."""
    with vf.deferred_init(seed=seed):
        model = GPT(CFG).to(dtype)
    return model


def batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (n, CFG.block_size + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]
