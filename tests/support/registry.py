"""The model registry: every way of running a model is checked against eager on these."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from varuna_fx.examples import GPT, GPTConfig, lm_loss


@dataclass
class Case:
    name: str
    model: nn.Module
    inputs: tuple | dict  # example inputs (positional tuple or keyword dict)
    target: Any
    loss_fn: Callable | None
    max_stages: int = 4
    tracer: str = "auto"

    @property
    def batch_size(self) -> int:
        values = self.inputs if isinstance(self.inputs, tuple) else tuple(self.inputs.values())
        return next(v for v in values if isinstance(v, torch.Tensor)).shape[0]

    def eager_loss(self, model: nn.Module | None = None) -> torch.Tensor:
        m = model or self.model
        out = m(*self.inputs) if isinstance(self.inputs, tuple) else m(**self.inputs)
        if self.loss_fn is not None:
            return self.loss_fn(out, self.target)
        if isinstance(out, torch.Tensor):
            return out
        return out.loss if hasattr(out, "loss") else out["loss"]


class MLP(nn.Module):
    def __init__(self, width: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


class ResNetish(nn.Module):
    """Residual conv blocks (GroupNorm: BatchNorm would make micro-batching change numerics)."""

    def __init__(self, channels: int = 8, blocks: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.GroupNorm(2, channels),
                          nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1))
            for _ in range(blocks)
        )
        self.fc = nn.Linear(channels, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        for block in self.blocks:
            x = F.relu(x + block(x))
        return self.fc(x.mean(dim=(2, 3)))


class UNetish(nn.Module):
    """Long skips: encoder outputs are used several stages later by the decoder."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.enc = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.mid = nn.Linear(width, width)
        self.dec = nn.ModuleList(nn.Linear(2 * width, width) for _ in range(4))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for layer in self.enc:
            x = torch.relu(layer(x))
            skips.append(x)
        x = torch.relu(self.mid(x))
        for layer in self.dec:
            x = torch.relu(layer(torch.cat([x, skips.pop()], dim=-1)))
        return self.out(x)


class KeywordDict(nn.Module):
    """Keyword inputs (one optional), a dict output; the loss is computed by loss_fn."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, 3)

    def forward(self, features: torch.Tensor, mask: torch.Tensor, scale: float = 2.0,
                extra: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = torch.relu(self.a(features)) * mask.unsqueeze(-1)
        h = torch.relu(self.b(h)) * scale
        return {"logits": self.c(h), "hidden": h}


class Albertish(nn.Module):
    """One block's weights reused at every depth (ALBERT), so every stage shares them."""

    def __init__(self, width: int = 16, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.shared = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.depth = depth
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for _ in range(self.depth):
            h = self.norm(h + torch.tanh(self.shared(h)))
        return self.head(h).pow(2).mean()  # the model returns its own loss


def _classification(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target)


def _dict_loss(out: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out["logits"].reshape(-1, 3), target.reshape(-1)) + \
        out["hidden"].pow(2).mean() * 0.01


def _hf_cases() -> list[Case]:
    try:
        import transformers as tf
    except ImportError:  # the dev extra installs it
        return []
    tf.logging.set_verbosity_error()
    cases = []
    torch.manual_seed(3)
    ids = torch.randint(0, 96, (4, 12))
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(
        n_layer=3, n_embd=32, n_head=2, vocab_size=96, n_positions=32, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    cases.append(Case("hf_gpt2", gpt2, {"input_ids": ids, "labels": ids}, None, None))
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(
        num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=96, max_position_embeddings=32, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0))
    cases.append(Case("hf_llama", llama, {"input_ids": ids, "labels": ids}, None, None))
    bert = tf.BertForMaskedLM(tf.BertConfig(
        num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        vocab_size=96, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0))
    cases.append(Case("hf_bert", bert, {"input_ids": ids, "labels": ids}, None, None))
    return cases


def registry() -> list[Case]:
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=3, n_head=2, n_embd=32))
    tokens = torch.randint(0, 128, (8, 17))
    cases = [
        Case("mlp", MLP(), (torch.randn(8, 32),), torch.randint(0, 4, (8,)), _classification),
        Case("gpt_tied", gpt, (tokens[:, :-1],), tokens[:, 1:], lm_loss),
        Case("resnet", ResNetish(), (torch.randn(4, 3, 8, 8),), torch.randint(0, 5, (4,)),
             _classification),
        Case("unet_skips", UNetish(), (torch.randn(8, 16),), torch.randn(8, 1),
             lambda out, t: F.mse_loss(out, t)),
        Case("kwargs_dict", KeywordDict(),
             {"features": torch.randn(8, 5, 16), "mask": torch.ones(8, 5)},
             torch.randint(0, 3, (8, 5)), _dict_loss),
        Case("albert_shared", Albertish(), (torch.randn(8, 8),), None, None),
    ]
    return cases + _hf_cases()


CASES = {c.name: c for c in registry()}


def as_float64(case: Case) -> Case:
    """``case`` in float64 (a copy: model and floating inputs), named ``<name>64``."""
    inputs = tuple(v.double() if v.is_floating_point() else v for v in case.inputs) \
        if isinstance(case.inputs, tuple) else case.inputs
    return dataclasses.replace(case, name=f"{case.name}64",
                               model=copy.deepcopy(case.model).double(), inputs=inputs)
