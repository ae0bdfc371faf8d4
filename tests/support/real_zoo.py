"""Real code patterns, written here (issue 40 item 6): tiny models in the styles of the field's
most used training code -- nanoGPT, torchtitan's Llama, minGPT, an encoder-decoder, mixtures of
experts, state-space scans, a ViT -- each with the idioms that broke capture, none copied.

``ZOO`` maps a name to ``(build, inputs, loss_fn)``: ``build()`` makes the model (call it
under ``vf.deferred_init`` for a deferred build), ``inputs`` the positional example inputs,
``loss_fn`` the one-argument loss over the model's output (None: the output is the loss).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from support.autograd_models import RoundSTE

B, T, V = 4, 8, 32  # batch, sequence, vocabulary


def _tokens(seed: int, shape: tuple[int, ...] = (B, T)) -> torch.Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


# -- nanoGPT style --------------------------------------------------------------------------


@dataclass
class NanoConfig:
    block_size: int = 16
    vocab_size: int = V
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 16
    dropout: float = 0.0
    bias: bool = True
    flash: bool = True  # SDPA; False: the masked-softmax path with a causal buffer


class NanoLayerNorm(nn.Module):
    """LayerNorm with an optional bias, the way nanoGPT writes it."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class NanoAttention(nn.Module):
    def __init__(self, cfg: NanoConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout, self.resid_dropout = nn.Dropout(cfg.dropout), nn.Dropout(cfg.dropout)
        self.n_head, self.n_embd, self.dropout, self.flash = \
            cfg.n_head, cfg.n_embd, cfg.dropout, cfg.flash
        if not self.flash:
            causal = torch.tril(torch.ones(cfg.block_size, cfg.block_size))
            self.register_buffer("bias", causal.view(1, 1, cfg.block_size, cfg.block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = self.attn_dropout(F.softmax(att, dim=-1))
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class NanoMLP(nn.Module):
    def __init__(self, cfg: NanoConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class NanoBlock(nn.Module):
    def __init__(self, cfg: NanoConfig) -> None:
        super().__init__()
        self.ln_1, self.attn = NanoLayerNorm(cfg.n_embd, cfg.bias), NanoAttention(cfg)
        self.ln_2, self.mlp = NanoLayerNorm(cfg.n_embd, cfg.bias), NanoMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """forward(idx, targets) -> (logits, loss), ignore_index=-1; logits of the last position
    only (x[:, [-1], :]) without targets; the LM head tied through wte.weight = lm_head.weight;
    GPT-2's init with the scaled residual projections."""

    def __init__(self, cfg: NanoConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or NanoConfig()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([NanoBlock(cfg) for _ in range(cfg.n_layer)]),
            ln_f=NanoLayerNorm(cfg.n_embd, cfg.bias)))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, \
            f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


# -- torchtitan-style Llama ------------------------------------------------------------------


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    ndim = x.ndim
    seqlen = x.shape[1]
    freqs_cis = freqs_cis[0:seqlen]
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim)
            .reshape(bs, slen, n_kv_heads * n_rep, head_dim))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class LlamaAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.n_rep, self.head_dim = n_heads // n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.attention = LlamaAttention(dim, n_heads, n_kv_heads)
        self.feed_forward = SwiGLU(dim, 4 * dim)
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Tokens -> logits; RoPE tables as a non-persistent complex buffer made by torch.polar."""

    def __init__(self, dim: int = 16, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2,
                 max_seq_len: int = 16, vocab: int = V) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // n_heads, max_seq_len * 2),
                             persistent=False)
        self.layers = nn.ModuleDict({str(i): LlamaBlock(dim, n_heads, n_kv_heads)
                                     for i in range(n_layers)})
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


# -- minGPT-style block ----------------------------------------------------------------------


class NewGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


class MinBlock(nn.Module):
    """The MLP is a ModuleDict called through a lambda stored on the block."""

    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size))
                             .view(1, 1, block_size, block_size))
        self.n_head = n_head
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(n_embd, 4 * n_embd),
                                      c_proj=nn.Linear(4 * n_embd, n_embd), act=NewGELU()))
        m = self.mlp
        self.mlpf = lambda x: m.c_proj(m.act(m.c_fc(x)))

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlpf(self.ln_2(x))


class MinGPT(nn.Module):
    def __init__(self, n_embd: int = 16, n_layer: int = 2, vocab: int = V, block: int = T
                 ) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block, n_embd)
        self.blocks = nn.Sequential(*[MinBlock(n_embd, 2, block) for _ in range(n_layer)])
        self.ln_f, self.head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device).unsqueeze(0)
        return self.head(self.ln_f(self.blocks(self.wte(idx) + self.wpe(pos))))


# -- encoder-decoder -------------------------------------------------------------------------


class CrossAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)
        self.heads = heads

    def forward(self, x: torch.Tensor, memory: torch.Tensor, causal: bool) -> torch.Tensor:
        b, t, d = x.shape
        s = memory.shape[1]
        q = self.q(x).view(b, t, self.heads, -1).transpose(1, 2)
        k, v = (y.view(b, s, self.heads, -1).transpose(1, 2)
                for y in self.kv(memory).chunk(2, dim=-1))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        if causal:
            mask = torch.ones(t, s, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        out = scores.softmax(-1) @ v
        return self.o(out.transpose(1, 2).reshape(b, t, d))


class EncoderDecoder(nn.Module):
    """forward(src, tgt_in, tgt_out) -> loss: an encoder, a decoder with self- and
    cross-attention, teacher forcing."""

    def __init__(self, dim: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.src_emb, self.tgt_emb = nn.Embedding(V, dim), nn.Embedding(V, dim)
        self.enc = nn.ModuleList(CrossAttention(dim, 2) for _ in range(layers))
        self.dec_self = nn.ModuleList(CrossAttention(dim, 2) for _ in range(layers))
        self.dec_cross = nn.ModuleList(CrossAttention(dim, 2) for _ in range(layers))
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, V)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor
                ) -> torch.Tensor:
        memory = self.src_emb(src)
        for layer in self.enc:
            memory = memory + layer(memory, memory, causal=False)
        h = self.tgt_emb(tgt_in)
        for self_attn, cross in zip(self.dec_self, self.dec_cross):
            h = h + self_attn(h, h, causal=True)
            h = h + cross(h, memory, causal=False)
        logits = self.out(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten())


# -- mixtures of experts ---------------------------------------------------------------------


class Expert(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class TopKMoE(nn.Module):
    """Top-k routing: each token's k experts by torch.topk; experts' outputs summed back into
    the tokens with index_add_ (routing by ``torch.where(mask)``: ``by_where``)."""

    def __init__(self, dim: int = 16, experts: int = 4, k: int = 2, by_where: bool = False,
                 vocab: int = V) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(experts))
        self.head = nn.Linear(dim, vocab)
        self.k, self.by_where = k, by_where

    def moe(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = torch.topk(self.router(x).softmax(-1), self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            if self.by_where:
                token, slot = torch.where(chosen == e)
            else:
                hit = (chosen == e).nonzero()
                token, slot = hit[:, 0], hit[:, 1]
            y = expert(x[token]) * weights[token, slot].unsqueeze(-1)
            out = out.index_add(0, token, y)
        return out.reshape(shape)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        return self.head(h + self.moe(h))


class DenseTopKMoE(TopKMoE):
    """Top-k routing without data-dependent sizes: every expert runs on every token and the
    top-k gates (a scatter into zeros) weight them; summed with index_add_ over the experts."""

    def moe(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(-1)
        weights, chosen = torch.topk(probs, self.k, dim=-1)
        gates = torch.zeros_like(probs).scatter(-1, chosen, weights / weights.sum(-1, True))
        outs = torch.stack([expert(x) for expert in self.experts], dim=-2)  # b t e d
        mixed = (outs * gates.unsqueeze(-1)).flatten(0, 2)
        index = torch.arange(x.shape[0] * x.shape[1], device=x.device).repeat_interleave(
            len(self.experts))
        return torch.zeros_like(x.flatten(0, 1)).index_add(0, index, mixed).view_as(x)


# -- state-space blocks ----------------------------------------------------------------------


class LinearScan(torch.autograd.Function):
    """h_t = a * h_{t-1} + u_t over dim 1, forward and backward written as scans that fill
    their outputs in place, one time step at a time."""

    @staticmethod
    def forward(ctx, u: torch.Tensor, a: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        h = torch.empty_like(u)
        state = torch.zeros_like(u[:, 0])
        for t in range(u.shape[1]):
            state = a * state + u[:, t]
            h[:, t] = state
        ctx.save_for_backward(h, a)
        return h

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        h, a = ctx.saved_tensors
        du = torch.empty_like(grad)
        carry = torch.zeros_like(grad[:, 0])
        for t in reversed(range(grad.shape[1])):
            carry = grad[:, t] + a * carry
            du[:, t] = carry
        previous = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
        da = (du * previous).sum(dim=(0, 1))
        return du, da


class StateSpace(nn.Module):
    """A diagonal linear recurrence with gates, over time as a Python loop or (``custom``)
    through :class:`LinearScan`; the quantised read-out uses a straight-through estimator."""

    def __init__(self, dim: int = 8, layers: int = 2, custom: bool = False,
                 vocab: int = V) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.inp = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.decay = nn.ParameterList(nn.Parameter(torch.linspace(-1, 1, dim))
                                      for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)
        self.custom = custom

    def scan(self, u: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        if self.custom:
            return LinearScan.apply(u, a)
        b, length, d = u.shape
        state = u.new_zeros(b, d)
        states = []
        for t in range(length):
            state = a * state + u[:, t]
            states.append(state)
        return torch.stack(states, dim=1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for inp, decay, out in zip(self.inp, self.decay, self.out):
            h = self.scan(inp(x), torch.sigmoid(decay))
            x = x + out(F.silu(h))
        return self.head(RoundSTE.apply(x * 8) / 8 if self.custom else x)


# -- ViT -------------------------------------------------------------------------------------


class ViT(nn.Module):
    def __init__(self, image: int = 8, patch: int = 4, dim: int = 16, layers: int = 2,
                 classes: int = 5) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(
            dim, 2, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


# -- the zoo ---------------------------------------------------------------------------------


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def own_loss(output: tuple[torch.Tensor, torch.Tensor | None], target: None) -> torch.Tensor:
    return output[1]  # nanoGPT's (logits, loss)


def class_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target)


IDS, TARGETS = _tokens(1), _tokens(2)
PIXELS = torch.randn(B, 3, 8, 8, generator=torch.Generator().manual_seed(3))
LABELS = torch.randint(0, 5, (B,), generator=torch.Generator().manual_seed(4))


@dataclass(frozen=True)
class Entry:
    build: Callable[[], nn.Module]
    inputs: tuple[Any, ...]  # positional model inputs, dim 0 the batch
    loss_fn: Callable[[Any, Any], torch.Tensor] | None  # loss_fn(output, target)
    target: torch.Tensor | None = None  # step's target=
    sdpa: bool = False  # attention through F.scaled_dot_product_attention


ZOO: dict[str, Entry] = {
    "nanogpt": Entry(NanoGPT, (IDS, TARGETS), own_loss, sdpa=True),
    "nanogpt-masked": Entry(lambda: NanoGPT(NanoConfig(flash=False)), (IDS, TARGETS),
                            own_loss),
    "llama": Entry(Llama, (IDS,), lm_loss, TARGETS, sdpa=True),
    "mingpt": Entry(MinGPT, (IDS,), lm_loss, TARGETS),
    "encoder-decoder": Entry(EncoderDecoder, (IDS, TARGETS[:, :-1], TARGETS[:, 1:]), None),
    "moe-topk": Entry(DenseTopKMoE, (IDS,), lm_loss, TARGETS),
    "moe-nonzero": Entry(TopKMoE, (IDS,), lm_loss, TARGETS),
    "moe-where": Entry(lambda: TopKMoE(by_where=True), (IDS,), lm_loss, TARGETS),
    "ssm-loop": Entry(StateSpace, (IDS,), lm_loss, TARGETS),
    "ssm-function": Entry(lambda: StateSpace(custom=True), (IDS,), lm_loss, TARGETS),
    "vit": Entry(ViT, (PIXELS,), class_loss, LABELS),
}


# -- factories for `varuna-fx train --model support.real_zoo:<name>` (byte-level corpus) ------


def train_llama() -> nn.Module:
    return Llama(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, vocab=256)


def train_mingpt() -> nn.Module:
    return MinGPT(n_embd=32, n_layer=2, vocab=256, block=16)


def train_nanogpt(seq_len: int = 16, vocab_size: int = 256) -> nn.Module:
    """nanoGPT sized by the run (``varuna-fx train`` offers seq_len and vocab_size)."""
    return NanoGPT(NanoConfig(block_size=seq_len, vocab_size=vocab_size))


def train_moe(vocab_size: int = 256) -> nn.Module:
    """Top-k routing by torch.where(mask): data-dependent sizes inside a stage."""
    return TopKMoE(dim=32, by_where=True, vocab=vocab_size)


def train_ssm(vocab_size: int = 256) -> nn.Module:
    """The state-space scan as a custom autograd Function (its own backward, fx keeps it)."""
    return StateSpace(dim=16, custom=True, vocab=vocab_size)
