"""Hugging Face's on-disk layout of safetensors weights: find, check, read and write the files.

A checkpoint is one ``model.safetensors``, or shards ``model-0000k-of-0000N.safetensors`` named
by ``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {key:
file}}``), or a single ``.safetensors`` file given by path. Nothing read runs code: safetensors
headers are JSON parsed and bounds-checked by the library (a header whose offsets do not cover
the file exactly is refused), the index is plain JSON whose file names must be plain names in
the checkpoint's directory, and every index entry must be in the file it names.

Reading (:func:`read_into`) never brings a whole file into memory: each needed tensor is copied
from ``safe_open``'s memory map straight into its destination, in row slices
(``get_slice``) of at most :data:`READ_WINDOW` bytes, and the file is reopened after each
window, so at most one window of mapped pages is resident beside the model (pages of a mapping
stay in the process's RSS until it is unmapped).

Writing (:func:`write_file`) hands safetensors pointers to the tensors' own memory
(``TensorSpec``, safetensors >= 0.8): no copy of a CPU tensor, and tensors that are views of one
buffer (ZeRO-1's flat buckets) are fine. Older safetensors get ``save_file``, with the views
cloned. Device tensors are copied to the host, one file's worth at a time.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ...errors import PretrainedError
from ...world import safe_json

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
READ_WINDOW = 16 << 20  # bytes read from one mapping before it is closed (and unmapped)
JSON_LIMIT = 64 << 20  # an index or config.json larger than this is not a checkpoint's
_ITEM_BYTES = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2,
               "BF16": 2, "I16": 2, "U16": 2}  # the rest: one byte (BOOL, U8, I8, F8_*)
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
PARTIAL = ".partial"  # a shard being written: HF's loaders never open it


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint, from its file's header (nothing read yet)."""

    file: str  # path of the file holding it
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, I64, BOOL, ...

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEM_BYTES.get(self.dtype, 1)


@dataclass(frozen=True)
class Checkpoint:
    path: str  # as given
    directory: str | None  # the checkpoint's directory (None: a lone file was given)
    entries: dict[str, Entry]  # every key the checkpoint offers, in file order


def open_checkpoint(path: str) -> Checkpoint:
    """The tensors a checkpoint directory (or one file, or an index file) offers, from the
    headers only; a :class:`PretrainedError` for anything that is not a readable checkpoint."""
    if os.path.isdir(path):
        single, index = os.path.join(path, SINGLE), os.path.join(path, INDEX)
        if os.path.isfile(single):  # as transformers: a single file wins over an index
            return Checkpoint(path, path, _headers(single))
        if os.path.isfile(index):
            return Checkpoint(path, path, _indexed(index))
        found = sorted(os.listdir(path))
        pickled = [f for f in found if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
        hint = (f" It holds {', '.join(pickled[:3])}: pickled weights can run code when "
                "loaded and are not read; convert them to safetensors with transformers "
                "(from_pretrained, then save_pretrained) in a process you trust."
                if pickled else "")
        raise PretrainedError(
            f"{path} holds neither {SINGLE} nor {INDEX}, so it is not a Hugging Face "
            f"safetensors checkpoint.{hint}")
    if not os.path.isfile(path):
        raise PretrainedError(f"{path} does not exist: pass a Hugging Face checkpoint "
                              f"directory (with {SINGLE} or {INDEX}) or a .safetensors file")
    if path.endswith(".json"):
        return Checkpoint(path, os.path.dirname(path) or ".", _indexed(path))
    return Checkpoint(path, None, _headers(path))


def read_json(path: str) -> Any:
    """A small JSON file (an index, a config.json), or a :class:`PretrainedError`."""
    try:
        if os.path.getsize(path) > JSON_LIMIT:
            raise PretrainedError(f"{path} is larger than {JSON_LIMIT >> 20} MiB: not the "
                                  "JSON file of a checkpoint")
        with open(path, encoding="utf-8") as f:
            return safe_json.loads(f.read())  # bounded in depth: a crafted file nests deep
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError included
        raise PretrainedError(f"{path} cannot be read as JSON: {exc}") from exc


def _indexed(index: str) -> dict[str, Entry]:
    data = read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise PretrainedError(f"{index} has no \"weight_map\" of tensor names to file names: "
                              "not a safetensors index")
    directory = os.path.dirname(index) or "."
    files = list(dict.fromkeys(weight_map.values()))
    bad = [f for f in files if os.path.basename(f) != f or f in ("", ".", "..")]
    if bad:  # a name like ../../etc/x would read outside the checkpoint
        raise PretrainedError(f"{index} names files outside its directory ({bad[0]!r}): "
                              "an index names shard files in its own directory only")
    headers = {f: _headers(os.path.join(directory, f)) for f in files}
    entries: dict[str, Entry] = {}
    for key, file in weight_map.items():
        entry = headers[file].get(key)
        if entry is None:
            raise PretrainedError(f"{index} says {key} is in {file}, but that file's header "
                                  "does not hold it: the checkpoint is incomplete or its "
                                  "files are from different saves")
        entries[key] = entry
    return entries


def _headers(file: str) -> dict[str, Entry]:
    try:
        with safe_open(file, framework="pt") as f:
            entries = {}
            for key in f.keys():
                view = f.get_slice(key)
                entries[key] = Entry(file, tuple(view.get_shape()), view.get_dtype())
            return entries
    except (SafetensorError, OSError) as exc:
        raise PretrainedError(f"{file} is not a readable safetensors file ({exc}): it is "
                              "damaged, truncated or not safetensors") from exc


# -- reading ---------------------------------------------------------------------------------


def read_into(items: Iterable[tuple[str, Entry, torch.Tensor]],
              window: int = READ_WINDOW) -> Iterator[torch.Tensor]:
    """Copy each checkpoint tensor ``(key, entry, destination)`` into its destination (any
    dtype and device: ``copy_`` casts), grouped by file; yields each destination once it is
    filled. The caller checked shapes and dtype kinds."""
    by_file: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for key, entry, dest in items:
        by_file.setdefault(entry.file, []).append((key, dest))
    for file, wanted in by_file.items():
        reader = _WindowedReader(file, window)
        try:
            for key, dest in wanted:
                reader.copy(key, dest)
                yield dest
        finally:
            reader.close()


def same_values(first: tuple[str, Entry], second: tuple[str, Entry],
                window: int = READ_WINDOW) -> bool:
    """Whether two checkpoint tensors ``(key, entry)`` hold the same bytes (same shape and
    dtype too), compared in row slices of at most ``window`` bytes each."""
    (key_a, a), (key_b, b) = first, second
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.nbytes == 0:
        return True
    reader_a, reader_b = _WindowedReader(a.file, window), _WindowedReader(b.file, window)
    try:
        if not a.shape:
            return _same_bytes(reader_a.part(key_a, None), reader_b.part(key_b, None))
        rows = a.shape[0]
        step = max(1, window // max(1, a.nbytes // rows))
        for start in range(0, rows, step):
            part_a, part_b = reader_a.part(key_a, start, step), reader_b.part(key_b, start, step)
            same = _same_bytes(part_a, part_b)
            del part_a, part_b  # views of the mappings go before a mapping may close
            if not same:
                return False
        return True
    finally:
        reader_a.close()
        reader_b.close()


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    # bytes, not values: a NaN equals itself, -0.0 differs from 0.0
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


class _WindowedReader:
    """``safe_open`` on one file, reopened after every ``window`` bytes copied."""

    def __init__(self, file: str, window: int) -> None:
        self.file, self.window = file, window
        self.handle: Any = None
        self.context: Any = None
        self.used = 0

    def _open(self) -> Any:
        if self.handle is None or self.used >= self.window:
            self.close()
            self.context = safe_open(self.file, framework="pt")
            self.handle = self.context.__enter__()
            self.used = 0
        return self.handle

    def copy(self, key: str, dest: torch.Tensor) -> None:
        with torch.no_grad():
            if dest.numel() == 0:
                return
            if dest.dim() == 0:
                dest.copy_(self._open().get_tensor(key))
                self.used += dest.element_size()
                return
            rows = dest.shape[0]
            row_bytes = max(1, dest[0].numel() * dest.element_size())
            step = max(1, self.window // row_bytes)
            for start in range(0, rows, step):
                part = self._open().get_slice(key)[start:start + step]
                dest[start:start + step].copy_(part)
                self.used += part.numel() * part.element_size()
                del part  # the view of the mapping goes before the mapping may close

    def part(self, key: str, start: int | None, rows: int = 0) -> torch.Tensor:
        """Rows ``start:start + rows`` of ``key`` (the whole 0-d tensor for ``None``)."""
        if start is None:
            value = self._open().get_tensor(key)
        else:
            value = self._open().get_slice(key)[start:start + rows]
        self.used += value.numel() * value.element_size()
        return value

    def close(self) -> None:
        if self.context is not None:
            self.context.__exit__(None, None, None)
        self.context = self.handle = None


# -- writing ---------------------------------------------------------------------------------


def shard_name(number: int, count: int) -> str:
    """Hugging Face's name for shard ``number`` (1-based) of ``count``; one file: model.safetensors."""
    return SINGLE if count == 1 else f"model-{number:05d}-of-{count:05d}.safetensors"


def write_file(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` (name -> tensor, any device) as one safetensors file at ``path``, with
    transformers' ``{"format": "pt"}`` metadata (it refuses files without it)."""
    if sys.byteorder != "little":
        raise PretrainedError("safetensors files are little-endian; writing them from a "
                              "big-endian machine is not supported")
    host = {k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}
    metadata = {"format": "pt"}
    try:
        from safetensors import TensorSpec, serialize_file
    except ImportError:  # safetensors < 0.8: save_file refuses views of one buffer
        from safetensors.torch import save_file

        seen: set[int] = set()
        owned = {}
        for k, t in host.items():
            key = t.untyped_storage().data_ptr()
            owned[k] = t.clone() if key in seen else t
            seen.add(key)
        save_file(owned, path, metadata=metadata)
        return
    specs = {k: TensorSpec(dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                           data_ptr=t.data_ptr(), data_len=t.numel() * t.element_size())
             for k, t in host.items()}
    serialize_file(specs, path, metadata=metadata)  # `host` keeps every pointer alive


def write_index(directory: str, weight_map: dict[str, str], total_size: int) -> None:
    """The index, atomically: written beside, then renamed over any earlier one."""
    temporary = os.path.join(directory, INDEX + PARTIAL)
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total_size},
                   "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, os.path.join(directory, INDEX))


def stale_weights(directory: str, keep: set[str]) -> list[str]:
    """Weight files of an earlier save in ``directory`` that the new one does not hold (only
    transformers' own names: other files are the user's)."""
    def weights(name: str) -> bool:
        return name == SINGLE or name == INDEX or SHARD.fullmatch(name) is not None

    return [f for f in sorted(os.listdir(directory)) if f not in keep and
            (weights(f) or (f.endswith(PARTIAL) and weights(f.removesuffix(PARTIAL))))]
