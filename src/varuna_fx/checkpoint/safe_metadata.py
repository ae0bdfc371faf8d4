"""Reading DCP's ``.metadata`` without running code, and refusing pickled entries.

DCP stores its metadata (which tensors, their shapes and dtypes, where their bytes are) as a
plain ``pickle`` of a :class:`~torch.distributed.checkpoint.metadata.Metadata`, and
``FileSystemReader.read_metadata`` unpickles it: a crafted file would run code on every rank
that loads it (and could then return genuine metadata, so the load succeeds with no sign).
Here the unpickler resolves only the globals DCP's metadata is made of -- its dataclasses,
``torch.Size``, dtypes, layouts, memory formats, a ``PosixPath`` -- and refuses every other one
(``os.system``, ``builtins.exec``, ``operator.getitem``...) before anything is called, so no
code but those constructors runs. What comes back is then checked for shape (the types of its
fields), since a tampered file can still combine the allowed types wrongly.

DCP's ``BYTE_IO`` entries (a pickled object per entry, loaded with ``torch.load(...,
weights_only=False)``) are refused by :class:`SafeLoadPlanner`: varuna_fx checkpoints store
only tensors, objects as uint8 tensors decoded with ``weights_only=True``.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from ..errors import CheckpointError

_DCP_TYPES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
              "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
_ALLOWED: dict[tuple[str, str], Any] = {
    **{("torch.distributed.checkpoint.metadata", n): getattr(dcp_metadata, n)
       for n in _DCP_TYPES if hasattr(dcp_metadata, n)},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("collections", "OrderedDict"): dict,
    **{("torch", n): v for n, v in vars(torch).items()
       if isinstance(v, (torch.dtype, torch.layout, torch.memory_format))},
}


def allow(module: str, name: str, value: Any) -> None:
    """Let the metadata unpickler resolve ``module.name`` (a storage's own ``_StorageInfo``
    subclass): it must be a plain data class whose construction runs no user code."""
    _ALLOWED[(module, name)] = value


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refused to load {module}.{name}: not part of DCP's checkpoint metadata"
            ) from None


def load_metadata(data: bytes, where: str) -> dcp_metadata.Metadata:
    """Unpickle DCP metadata from ``data`` resolving only the metadata types; checked."""
    try:
        metadata = _Unpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - whatever a tampered file makes pickle raise
        raise CheckpointError(
            f"{where}: DCP metadata refused ({type(exc).__name__}: {exc}); a checkpoint's "
            "metadata may hold only DCP's own types, so loading it never runs code. The file "
            "was tampered with or not written by torch.distributed.checkpoint: do not load it"
        ) from exc
    check_metadata(metadata, where)
    return metadata


def check_metadata(metadata: Any, where: str) -> None:
    """The fields DCP and varuna_fx read have the types they expect."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: DCP metadata is malformed ({what}): the checkpoint "
                               "was tampered with or not written by varuna_fx")

    if not isinstance(metadata, dcp_metadata.Metadata):
        raise bad(f"a {type(metadata).__name__}, not a Metadata")
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        raise bad("state_dict_metadata is not a dict")
    for key, entry in entries.items():
        if not isinstance(key, str):
            raise bad(f"key {key!r} is not a string")
        if isinstance(entry, dcp_metadata.TensorStorageMetadata):
            props = getattr(entry, "properties", None)
            if not isinstance(getattr(props, "dtype", None), torch.dtype) or \
                    not isinstance(getattr(entry, "size", None), torch.Size) or \
                    not isinstance(getattr(entry, "chunks", None), list) or \
                    not all(isinstance(c, dcp_metadata.ChunkStorageMetadata) and
                            _ints(c.offsets) and _ints(c.sizes) for c in entry.chunks):
                raise bad(f"entry {key} has no valid dtype, size or chunks")
        elif not isinstance(entry, dcp_metadata.BytesStorageMetadata):
            raise bad(f"entry {key} is a {type(entry).__name__}")
    if not isinstance(getattr(metadata, "storage_meta", None),
                      (dcp_metadata.StorageMeta, type(None))):
        raise bad("storage_meta is not a StorageMeta")
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise bad("storage_data is not a dict")
    for index, info in storage.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or \
                not isinstance(info, _StorageInfo) or \
                not isinstance(info.relative_path, str) or \
                not _ints((info.offset, info.length)) or info.offset < 0 or info.length < 0 or \
                type(getattr(info, "crc32", None)) not in (int, type(None)) or \
                type(getattr(info, "bound", False)) is not bool:
            raise bad(f"storage entry {index!r} -> {info!r}")
        parts = pathlib.PurePosixPath(info.relative_path).parts
        if not parts or ".." in parts or parts[0] == "/":  # only files inside the checkpoint
            raise bad(f"storage entry {index!r} names the file {info.relative_path!r}")


def _ints(values: Any) -> bool:
    try:
        return all(type(v) is int for v in values)
    except TypeError:
        return False


class SafeMetadataReader:
    """Mixin for a ``FileSystemReader``: ``read_metadata`` through :func:`load_metadata`, and
    only files that resolve inside the checkpoint directory (:meth:`inside`)."""

    def inside(self, relative: str) -> str:
        """The path of the checkpoint's file ``relative``; refused when it resolves outside
        the checkpoint (a symlink replacing a file: varuna_fx never writes one)."""
        root = os.path.realpath(str(self.path))  # type: ignore[attr-defined]
        full = os.path.join(str(self.path), relative)  # type: ignore[attr-defined]
        real = os.path.realpath(full)
        if os.path.commonpath([root, real]) != root:
            raise CheckpointError(
                f"{full} resolves to {real}, outside the checkpoint: a file replaced by a "
                "link out of the directory, which varuna_fx never writes; the checkpoint was "
                "tampered with or not written by varuna_fx (copy the real file in instead)")
        return full

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))  # type: ignore[attr-defined]
        self.inside(os.path.relpath(str(path), str(self.path)))  # type: ignore[attr-defined]
        try:
            with self.fs.create_stream(path, "rb") as f:  # type: ignore[attr-defined]
                data = f.read()
        except OSError as exc:
            raise CheckpointError(f"{path}: DCP metadata unreadable ({exc})") from exc
        metadata = load_metadata(data, str(path))
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[attr-defined]
        return metadata


class LegacyReader(SafeMetadataReader, FileSystemReader):
    """Format 1 (DCP's own ``torch.save`` records, read ``weights_only``), metadata read safely."""

    def read_data(self, plan: Any, planner: Any) -> Any:
        for item in plan.items:
            self.inside(self.storage_data[item.storage_index].relative_path)
        return super().read_data(plan, planner)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner without its pickle path: a ``BYTE_IO`` entry is refused."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn} is a pickled object (DCP BYTE_IO), "
            "which varuna_fx never writes and does not unpickle: the checkpoint was tampered "
            "with or not written by varuna_fx"
        )
