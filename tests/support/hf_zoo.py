"""Hugging Face architectures from tiny configs (``ZOO``), with inputs whose labels keep
different counts per micro-batch; shared by capture/test_hf_models.py and
init/test_deferred_init.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from support.label_models import B, S, V, token_ids

tf = pytest.importorskip("transformers")
tf.logging.set_verbosity_error()


def _padded(labels: torch.Tensor) -> torch.Tensor:
    """Labels of unequal lengths: the first micro-batch keeps fewer than the second."""
    labels = labels.clone()
    labels[:2, S // 2:] = -100
    return labels


def decoder_config(**extra: object) -> dict[str, object]:
    return dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                vocab_size=V, max_position_embeddings=32, use_cache=False, bos_token_id=1,
                eos_token_id=2, pad_token_id=0, **extra)


def _encoder(**extra: object) -> dict[str, object]:
    return dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                vocab_size=V, max_position_embeddings=40, pad_token_id=0,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **extra)


def _lm(model: nn.Module) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    ids = token_ids(1)
    return model, {"input_ids": ids, "labels": _padded(ids)}


def _seq2seq(model: nn.Module) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    return model, {"input_ids": token_ids(1), "labels": _padded(token_ids(2))}


def _image(model: nn.Module) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return model, {"pixel_values": torch.randn(B, 3, 16, 16, generator=g),
                   "labels": torch.randint(0, 5, (B,), generator=g)}


def _classify(model: nn.Module, problem: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    labels = {"regression": lambda: torch.randn(B, 3, generator=g),
              "single_label_classification":
                  lambda: torch.randint(0, 3, (B,), generator=g)}[problem]()
    return model, {"input_ids": token_ids(1), "labels": labels}


# name -> a builder of (model, inputs); every text model's labels are padded with -100
ZOO: dict[str, Callable[[], tuple[nn.Module, dict[str, torch.Tensor]]]] = {
    "qwen2": lambda: _lm(tf.Qwen2ForCausalLM(tf.Qwen2Config(**decoder_config(num_key_value_heads=1)))),
    "mistral": lambda: _lm(tf.MistralForCausalLM(tf.MistralConfig(
        **decoder_config(num_key_value_heads=1, sliding_window=4)))),
    "gemma": lambda: _lm(tf.GemmaForCausalLM(tf.GemmaConfig(
        **decoder_config(num_key_value_heads=1, head_dim=16)))),
    "phi": lambda: _lm(tf.PhiForCausalLM(tf.PhiConfig(
        **decoder_config(resid_pdrop=0.0, embd_pdrop=0.0)))),
    "gpt_neox": lambda: _lm(tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
        **decoder_config(hidden_dropout=0.0, attention_dropout=0.0)))),
    "opt": lambda: _lm(tf.OPTForCausalLM(tf.OPTConfig(
        num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=2, vocab_size=V,
        max_position_embeddings=32, use_cache=False, word_embed_proj_dim=32, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, dropout=0.0, attention_dropout=0.0))),
    "falcon": lambda: _lm(tf.FalconForCausalLM(tf.FalconConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=V,
        use_cache=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_dropout=0.0,
        attention_dropout=0.0))),
    "bloom": lambda: _lm(tf.BloomForCausalLM(tf.BloomConfig(
        n_layer=2, hidden_size=32, n_head=2, vocab_size=V, use_cache=False, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, hidden_dropout=0.0, attention_dropout=0.0))),
    "gptj": lambda: _lm(tf.GPTJForCausalLM(tf.GPTJConfig(
        n_layer=2, n_embd=32, n_head=2, rotary_dim=8, vocab_size=V, n_positions=32,
        use_cache=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0))),
    "distilbert": lambda: _lm(tf.DistilBertForMaskedLM(tf.DistilBertConfig(
        n_layers=2, dim=32, hidden_dim=64, n_heads=2, vocab_size=V, max_position_embeddings=32,
        pad_token_id=0, dropout=0.0, attention_dropout=0.0))),
    "albert": lambda: _lm(tf.AlbertForMaskedLM(tf.AlbertConfig(
        **_encoder(), embedding_size=16))),
    "deberta_v2": lambda: _lm(tf.DebertaV2ForMaskedLM(tf.DebertaV2Config(
        **_encoder(), relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"],
        max_relative_positions=16))),
    "t5": lambda: _seq2seq(tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
        num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=2, use_cache=False))),
    "bart": lambda: _seq2seq(tf.BartForConditionalGeneration(tf.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
        use_cache=False))),
    "vit": lambda: _image(tf.ViTForImageClassification(tf.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))),
    "convnext": lambda: _image(tf.ConvNextForImageClassification(tf.ConvNextConfig(
        num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_labels=5, image_size=16, num_stages=2))),
    "bert_regression": lambda: _classify(tf.BertForSequenceClassification(tf.BertConfig(
        **_encoder(), num_labels=3, problem_type="regression")), "regression"),
    "llama_single_label": lambda: _classify(tf.LlamaForSequenceClassification(tf.LlamaConfig(
        **decoder_config(), num_labels=3, problem_type="single_label_classification")),
        "single_label_classification"),
}
