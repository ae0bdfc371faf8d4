"""The model of ``varuna-fx train``: the built-in GPT, a Hugging Face config, or a factory.

Every model is built under ``vf.deferred_init(seed)``: nothing is allocated until
``vf.compile`` gives each rank its stage's tensors (initialised with the same values on every
layout). A run that resumes or starts from pretrained weights also skips the random
initialisers (``vf.skip_init``): the load sets every weight. The loss is next-token cross
entropy over the model's logits, whatever form they come in (a tensor, an output object with
``.logits``, a tuple whose first item they are).
"""

from __future__ import annotations

import inspect
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import InputError
from ..examples import GPT, GPTConfig, lm_loss
from ..init.record import deferred_init
from ..init.skip import skip_init
from .config import AUTO, BUILTIN_GPT, TrainConfig, hf_config_path
from .factory import load_factory


@dataclass
class TrainModel:
    model: nn.Module
    vocab_size: int | None  # the input embedding's rows, when found
    description: str
    # forward takes the next tokens itself (nanoGPT's forward(idx, targets=None) -> (logits,
    # loss), whose logits without targets are the last position's only): fed them, and its
    # own loss is the loss
    targets_in_forward: bool = False


TARGETS = "targets"  # nanoGPT's name; Hugging Face's labels are shifted inside, so not these


def takes_targets(model: nn.Module) -> bool:
    """Whether ``model.forward`` has a ``targets`` parameter (besides the token ids)."""
    try:
        return TARGETS in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def own_loss(output: Any, _target: Any) -> torch.Tensor:
    """The loss a model fed its targets returns: ``(logits, loss)``, ``.loss`` or
    ``{"loss": ...}`` (``loss_fn`` of those models: the output tensor itself, so micro-batches
    are weighted as eager's mean over the whole batch)."""
    if isinstance(output, tuple | list) and len(output) > 1:
        return output[1]
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise InputError(f"the model takes targets, but given them it returned "
                         f"{type(output).__name__} with no loss: return (logits, loss)")
    return loss


def factory_arguments(factory: Any, **offered: Any) -> dict[str, Any]:
    """Of ``offered`` (the run's seq_len and vocab_size), the ones the factory's signature
    accepts by name (or all with ``**kwargs``); None values are left to its defaults."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
    anything = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return {k: v for k, v in offered.items()
            if v is not None and (anything or (k in params and params[k].kind not in (
                inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL)))}


def next_token_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the logits against the next tokens (``loss_fn`` of every model)."""
    logits = getattr(output, "logits", None)
    if logits is None:
        logits = output[0] if isinstance(output, tuple | list) else output
    return lm_loss(logits, target)


def build_model(cfg: TrainConfig, data_vocab: int | None, largest_token: int, *,
                initialise: bool, tokenizer_vocab: int | None = None) -> TrainModel:
    """The configured model, built deferred; ``initialise`` False skips the random
    initialisers (a checkpoint or pretrained weights will be loaded)."""
    with ExitStack() as stack:
        stack.enter_context(deferred_init(seed=cfg.seed))
        stack.enter_context(skip_init(enabled=not initialise))
        if cfg.model == BUILTIN_GPT:
            made = _gpt(cfg, data_vocab)
        elif ":" in cfg.model and not hf_config_path(cfg.model).is_file():
            made = _factory(cfg.model, seq_len=cfg.seq_len,
                            vocab_size=data_vocab if cfg.vocab_size == AUTO else cfg.vocab_size)
        else:
            made = _hugging_face(cfg)
    if made.vocab_size is not None and tokenizer_vocab is not None and \
            tokenizer_vocab > made.vocab_size:
        raise InputError(f"the tokenizer {cfg.tokenizer} has a vocabulary of "
                         f"{tokenizer_vocab:,}, but the model's embedding has "
                         f"{made.vocab_size:,} rows: ids it makes would have none; give a "
                         "model (or --vocab-size) covering the tokenizer, or its own tokenizer")
    if made.vocab_size is not None and largest_token >= made.vocab_size:
        raise InputError(f"the data holds token id {largest_token}, but the model's vocabulary "
                         f"has {made.vocab_size} entries: give a model whose vocabulary covers "
                         "the data's")
    return made


def _gpt(cfg: TrainConfig, data_vocab: int | None) -> TrainModel:
    vocab = data_vocab if cfg.vocab_size == AUTO else cfg.vocab_size
    if vocab is None:
        raise InputError(f"vocab_size = auto, but {cfg.data} is a token file, which does not "
                         "say its vocabulary: give the tokenizer's (--vocab-size 50304)")
    gpt = GPTConfig(vocab_size=vocab, block_size=cfg.seq_len, n_layer=cfg.n_layer,
                    n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout)
    model = GPT(gpt)
    params = sum(p.numel() for p in model.parameters())
    return TrainModel(model, vocab, f"the built-in GPT ({cfg.n_layer} layers, {cfg.n_embd} "
                                    f"wide, {cfg.n_head} heads, vocabulary {vocab}, context "
                                    f"{cfg.seq_len}): {params / 1e6:.2f}M parameters")


def _hugging_face(cfg: TrainConfig) -> TrainModel:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise InputError(f"model = {cfg.model!r} is a Hugging Face config, but transformers is "
                         "not installed: pip install transformers") from None
    path = hf_config_path(cfg.model)
    try:  # never trust_remote_code: a config that needs code of its own is refused
        config = AutoConfig.from_pretrained(str(path))
    except (ValueError, OSError, KeyError) as exc:
        raise InputError(f"{path}: not a Hugging Face config this transformers reads: "
                         f"{exc}") from None
    config.use_cache = False  # no KV cache in training (and a traced graph has no use for it)
    longest = getattr(config, "max_position_embeddings", None) or \
        getattr(config, "n_positions", None)
    if longest is not None and cfg.seq_len > longest:
        raise InputError(f"seq_len = {cfg.seq_len} is longer than {path} allows "
                         f"({longest} positions)")
    model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    return TrainModel(model, _embedding_rows(model),
                      f"{type(model).__name__} from {path}: {params / 1e6:.2f}M parameters")


def _factory(spec: str, **run: Any) -> TrainModel:
    factory = load_factory(spec)  # a missing module or function: InputError, saying which
    made = factory(**factory_arguments(factory, **run))
    model = made[0] if isinstance(made, tuple | list) and made else made
    if not isinstance(model, nn.Module):
        raise InputError(f"--model {spec}: the factory returned {type(made).__name__}; return "
                         "an nn.Module taking token ids (batch, seq_len), or a tuple whose "
                         "first item is one")
    params = sum(p.numel() for p in model.parameters())
    fed = takes_targets(model)
    return TrainModel(model, _embedding_rows(model),
                      f"{type(model).__name__} from {spec}: {params / 1e6:.2f}M parameters"
                      + (" (fed its targets; its own loss)" if fed else ""), fed)


def _embedding_rows(model: nn.Module) -> int | None:
    """The vocabulary of the input embedding (HF's accessor, else the first nn.Embedding)."""
    getter = getattr(model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else None
    if not isinstance(embedding, nn.Embedding):
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return embedding.num_embeddings if embedding is not None else None
