"""``vf.TokenDataset``: (input, next-token target) windows over a 1-D token source.

Sources: a token file (``.bin`` of uint16 or uint32, memory-mapped with numpy, as nanoGPT's
``prepare.py`` and Megatron's indexed datasets write them), any other file read as bytes (raw
text: a vocabulary of 256), or a 1-D integer tensor or array. Sample ``i`` is the tokens
``[i*stride, i*stride + seq_len]``: its first ``seq_len`` are the input, its last ``seq_len``
the target. Only the window asked for is read from disk.

A ``.bin`` file's dtype is ``dtype=`` when given; else a Megatron ``.idx`` beside it names it;
else a size that is not a multiple of 4 bytes means uint16; else the first MiB decides: read as
uint32, tokens of a real vocabulary stay below 2**18 (262,144: above Gemma's 256k), while
uint16 tokens read in pairs exceed that unless every other token is below 4. A file too short
to tell is refused, asking for ``dtype=``.

Token ids are never negative: an in-memory source holding one is refused when the dataset is
made; a file of a signed type (Megatron's int32 / int64) when a window holding one is read (a
pass over a file of billions of tokens is the caller's choice: ``varuna-fx train`` makes it,
``first_negative`` below). Either way an ``InputError`` names the place, before the embedding
fails on it inside a step.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import InputError
from .sampler import check_count

TOKEN_SUFFIXES = (".bin",)
_DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "uint8": np.uint8}
# Megatron-Core indexed dataset: b"MMIDIDX\x00\x00", version <Q, dtype code <B
_MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
_MEGATRON_CODES = {1: np.uint8, 8: np.uint16, 4: np.int32, 5: np.int64}
_UINT32_LIMIT = 2 ** 18
_SNIFF_WORDS = 2 ** 18  # 1 MiB of uint32
_MIN_SNIFF_WORDS = 64


class TokenDataset(torch.utils.data.Dataset):
    """``(input, target)`` int64 tensors of ``seq_len`` tokens each, target shifted by one."""

    def __init__(self, source: str | os.PathLike | torch.Tensor | np.ndarray, seq_len: int, *,
                 dtype: str | None = None, stride: int | None = None) -> None:
        self.seq_len = check_count("seq_len", seq_len)
        self.stride = check_count("stride", stride) if stride is not None else self.seq_len
        self.tokens, self.vocab_size, self.source = _open(source, dtype)
        n = len(self.tokens)
        if n < self.seq_len + 1:
            raise InputError(
                f"seq_len={self.seq_len} is too long for {self.source}: it holds {n} tokens and "
                f"one sample needs seq_len + 1 = {self.seq_len + 1} (its input and the next-token "
                "target). Use a shorter seq_len or more data")
        self._length = (n - 1 - self.seq_len) // self.stride + 1
        # unsigned files cannot hold a negative id; signed ones are checked window by window,
        # an in-memory source here, once
        on_disk = isinstance(self.tokens, np.memmap)
        self._signed = on_disk and _signed(self.tokens)
        if not on_disk:
            refuse_negative(self.tokens, self.source)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self._length <= index < self._length:
            raise IndexError(f"sample {index} of a TokenDataset of {self._length}")
        start = (index % self._length) * self.stride
        window = self.tokens[start:start + self.seq_len + 1]
        if isinstance(window, torch.Tensor):
            window = window.to(torch.int64)
        else:
            window = torch.from_numpy(np.asarray(window, dtype=np.int64))
        if self._signed and bool((window < 0).any()):
            at = start + int(torch.nonzero(window < 0)[0, 0])
            raise InputError(f"sample {index} of {self.source}: negative token id "
                             f"{int(self.tokens[at])} at position {at}; token ids start at 0 "
                             "(a padding or ignore value written into the data?): fix the "
                             "token file")
        return window[:-1], window[1:]

    def __getstate__(self) -> dict[str, Any]:
        # a worker process (spawn) reopens the file instead of receiving a copy of it
        state = dict(self.__dict__)
        if isinstance(self.tokens, np.memmap):
            state["tokens"] = (str(self.tokens.filename), self.tokens.dtype.str)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state["tokens"], tuple):
            path, kind = state["tokens"]
            state["tokens"] = np.memmap(path, dtype=np.dtype(kind), mode="r")
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (f"TokenDataset({self.source}, seq_len={self.seq_len}, {len(self.tokens)} tokens, "
                f"{len(self)} samples)")


def _signed(tokens: Any) -> bool:
    if isinstance(tokens, torch.Tensor):
        return tokens.dtype.is_signed
    return bool(np.issubdtype(np.asarray(tokens[:0]).dtype, np.signedinteger))


def first_negative(tokens: Any) -> int | None:
    """The position of the first negative id in a 1-D token sequence (one pass, in chunks
    of a memory map), or None."""
    if not _signed(tokens):
        return None
    chunk = 1 << 24
    for lo in range(0, len(tokens), chunk):
        part = tokens[lo:lo + chunk]
        part = part.numpy() if isinstance(part, torch.Tensor) else np.asarray(part)
        if part.size and part.min() < 0:
            return lo + int(np.argmax(part < 0))
    return None


def refuse_negative(tokens: Any, source: str) -> None:
    """InputError naming the first negative id of ``tokens``, if one is there."""
    at = first_negative(tokens)
    if at is not None:
        raise InputError(f"{source} holds the negative token id {int(tokens[at])} at position "
                         f"{at}; token ids start at 0 (the model's embedding has no row for "
                         "it: a padding or ignore value written into the data?)")


def _open(source: Any, dtype: str | None) -> tuple[Any, int | None, str]:
    """(a 1-D indexable of tokens, the vocabulary size when the source fixes it, its name)."""
    if dtype is not None and dtype not in _DTYPES:
        raise InputError(f"dtype must be one of {sorted(_DTYPES)} (the token file's integer "
                         f"type), got {dtype!r}")
    if isinstance(source, torch.Tensor | np.ndarray):
        return _array(source), None, f"a {type(source).__name__} of {len(source)} tokens"
    if not isinstance(source, str | os.PathLike):
        raise InputError(f"TokenDataset reads a path, a tensor or a numpy array, got "
                         f"{type(source).__name__}")
    path = Path(source)
    if not path.is_file():
        raise InputError(f"TokenDataset: {path} is not a file")
    if path.stat().st_size == 0:
        raise InputError(f"TokenDataset: {path} is empty")
    if dtype is None and path.suffix not in TOKEN_SUFFIXES:
        dtype = "uint8"  # text: its bytes are the tokens
    kind = _DTYPES[dtype] if dtype is not None else _infer(path)
    size = path.stat().st_size
    width = np.dtype(kind).itemsize
    if size % width:
        raise InputError(f"{path} holds {size} bytes, not a whole number of {np.dtype(kind).name} "
                         "tokens: pass the dtype it was written with")
    tokens = np.memmap(path, dtype=kind, mode="r")
    return tokens, 256 if kind is np.uint8 else None, str(path)


def _array(source: torch.Tensor | np.ndarray) -> Any:
    floating = source.is_floating_point() or source.is_complex() \
        if isinstance(source, torch.Tensor) else not np.issubdtype(source.dtype, np.integer)
    if source.ndim != 1 or floating:
        raise InputError(f"TokenDataset needs a 1-D integer sequence of token ids, got shape "
                         f"{tuple(source.shape)} of {source.dtype}: flatten it (.reshape(-1)) or "
                         "tokenize the text first")
    return source


def _infer(path: Path) -> Any:
    """The integer type of a ``.bin`` token file (see the module's docstring)."""
    index = path.with_suffix(".idx")
    if index.is_file():
        with open(index, "rb") as f:
            head = f.read(len(_MEGATRON_MAGIC) + 9)
        if head.startswith(_MEGATRON_MAGIC) and len(head) == len(_MEGATRON_MAGIC) + 9:
            code = head[-1]
            if code in _MEGATRON_CODES:
                return _MEGATRON_CODES[code]
            raise InputError(f"{index} names token dtype code {code}, which is not an integer "
                             "type TokenDataset reads")
    size = path.stat().st_size
    if size % 4:
        return np.uint16
    words = np.fromfile(path, dtype=np.uint32, count=_SNIFF_WORDS)
    if len(words) < _MIN_SNIFF_WORDS:
        raise InputError(
            f"cannot tell whether {path} holds uint16 or uint32 tokens from its {size} bytes: "
            "pass dtype='uint16' (nanoGPT) or dtype='uint32' to TokenDataset")
    return np.uint32 if int(words.max()) < _UINT32_LIMIT else np.uint16
