"""What the pretrained-weights tests share with their rank script: a tiny GPT-2 (tied head) and
a ``safe_open`` that counts the bytes copied out of safetensors files, per key."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import varuna_fx.checkpoint.hf.safetensors_files as files
from support.label_models import V, token_ids

tf = pytest.importorskip("transformers")
tf.logging.set_verbosity_error()

IDS = token_ids(1)


def gpt2_config(**extra: Any) -> Any:
    return tf.GPT2Config(**{**dict(n_layer=2, n_embd=32, n_head=2, vocab_size=V, n_positions=32,
                                   use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0, bos_token_id=0, eos_token_id=0), **extra})


def count_reads(reads: dict[str, int]) -> Any:
    """A ``safe_open`` for ``safetensors_files`` that adds to ``reads[key]`` the bytes of every
    tensor or slice taken out of a file (headers are not counted)."""
    real = files.safe_open

    class Slice:
        def __init__(self, inner: Any, key: str) -> None:
            self.inner, self.key = inner, key

        def __getitem__(self, index: Any) -> torch.Tensor:
            part = self.inner[index]
            reads[self.key] = reads.get(self.key, 0) + part.numel() * part.element_size()
            return part

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    class Counting:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.context = real(*args, **kwargs)

        def __enter__(self) -> Counting:
            self.handle = self.context.__enter__()
            return self

        def __exit__(self, *exc: Any) -> Any:
            return self.context.__exit__(*exc)

        def keys(self) -> list[str]:
            return self.handle.keys()

        def get_slice(self, key: str) -> Slice:
            return Slice(self.handle.get_slice(key), key)

        def get_tensor(self, key: str) -> torch.Tensor:
            t = self.handle.get_tensor(key)
            reads[key] = reads.get(key, 0) + t.numel() * t.element_size()
            return t

    return Counting
