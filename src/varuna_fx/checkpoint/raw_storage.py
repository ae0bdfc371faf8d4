"""DCP storage that writes tensors as raw bytes and reads them straight into their destination.

DCP's ``FileSystemWriter`` wraps every tensor in its own ``torch.save`` archive (a zip with a
pickle, a CRC and small writes) and its ``FileSystemReader`` unpickles each one into a new tensor
and copies that into the destination: two copies per tensor, and per-entry Python work. Here
the rest of DCP stays as it is (planning, metadata, the collectives, deduplication, async
staging, re-sharding by the load planner); only the bytes differ:

* save: each writer thread gets one file per rank and writes the tensors' memory into it with
  one ``write`` per tensor (no serialisation, no copy), then fsyncs it. The metadata records
  (file, offset, length) per entry, as DCP's own writer does.
* load: each entry is ``readinto`` its destination tensor's memory when it is a whole,
  contiguous CPU tensor of the stored dtype (the common case: the model's own tensors); else
  into a temporary tensor of the stored shape and dtype, which is then narrowed and copied
  (casting) into the destination, as DCP's reader does.

The bytes are in the tensor's native byte order; a checkpoint records ``sys.byteorder`` in its
marker and refuses to load on a machine of the other order.

Checksums (format 4): each entry's CRC-32 is computed as it is written, over what names the
entry (its key, the chunk's offsets in the tensor, the tensor's and the chunk's shapes, the
dtype, the file, the byte offset and length: :func:`entry_header`) followed by its bytes, and
recorded beside its (file, offset, length) in the metadata (:class:`ChecksummedInfo`). A load
verifies every entry it reads against what the metadata says it is, so a bit flip inside a
tensor's bytes, or two equal-shaped entries swapped in the metadata together with their
checksums, raises :class:`CheckpointError` naming the file and the entry. Format 3 (checksums
of the bytes alone) loads verified by those; format 2 (no checksums) loads unverified. The
reader's metadata is read without running code (``safe_metadata.py``), and every file it opens
must resolve inside the checkpoint (no symlink out of it).
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..errors import CheckpointError
from .safe_metadata import SafeMetadataReader, allow

SUFFIX = ".raw"
CHUNK = 1 << 30  # one syscall moves at most ~2 GiB on Linux: write/read in pieces below that


@dataclass
class ChecksummedInfo(_StorageInfo):
    """Where an entry's bytes are, and their CRC-32 (None: written without checksums);
    ``bound``: the CRC covers :func:`entry_header` before the bytes (format 4)."""

    crc32: int | None = None
    bound: bool = False  # (a format-3 record unpickles without it: the class default)


allow(__name__, "ChecksummedInfo", ChecksummedInfo)


def entry_header(fqn: str, chunk_offsets: Any, size: Any, chunk_sizes: Any, dtype: Any,
                 file: str, offset: int, length: int) -> bytes:
    """What names an entry, as the bytes its checksum starts from: a checksum then holds
    only for these bytes under this key, at this place in this tensor, in this file."""
    def ints(values: Any) -> str:
        return ",".join(str(int(v)) for v in values)

    return "\0".join(["varuna_fx entry", fqn, ints(chunk_offsets), ints(size),
                       ints(chunk_sizes), str(dtype), file, str(int(offset)),
                       str(int(length))]).encode() + b"\0"


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor as a writable byte buffer (no copy)."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray())
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


class RawWriter(FileSystemWriter):
    """``FileSystemWriter`` with raw tensor bytes (see the module docstring)."""

    # Another file (and thread, and fsync) per this many bytes, up to ``thread_count``: several
    # writes in flight keep a disk busy, but for a small checkpoint the fsyncs dominate.
    bytes_per_file = 128 << 20
    checksums = True  # CRC-32 per entry (bench/bench_checkpoint.py measures the cost)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix: _StoragePrefix = plan.storage_data
        total = sum(_size(item) for item in plan.items)
        files = min(max(1, self.thread_count), 1 + total // max(1, self.bytes_per_file))
        buckets = _balance(plan.items, files)
        results: list[list[WriteResult]] = [[] for _ in buckets]
        errors: list[BaseException] = []

        def write(i: int) -> None:
            name = f"{prefix.prefix}{i}{SUFFIX}"
            try:
                results[i] = _write_file(os.path.join(self.path, name), name, buckets[i],
                                         planner, self.sync_files, self.checksums)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(i,)) for i in range(1, len(buckets))]
        for t in threads:
            t.start()
        write(0)
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        done: Future[list[WriteResult]] = Future()
        done.set_result([r for rs in results for r in rs])
        return done


class RawReader(SafeMetadataReader, FileSystemReader):
    """``FileSystemReader`` for what :class:`RawWriter` wrote (``verify``: every entry must
    carry a checksum, format 3; ``bound``: one bound to its entry, format 4)."""

    verify = False
    bound = False

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.tensors = metadata.state_dict_metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path,
                                []).append(item)
        errors: list[BaseException] = []

        def read(relative: str, items: list[Any]) -> None:
            try:
                # in file order: the disk reads forwards
                items.sort(key=lambda it: self.storage_data[it.storage_index].offset)
                with open(self.inside(relative), "rb", buffering=0) as f:
                    for item in items:
                        self._read_item(f, item, planner)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
                errors.append(exc)

        # a thread per file, as they were written: reads and checksums (zlib releases the
        # GIL) of several files overlap
        work = list(per_file.items())
        threads = [threading.Thread(target=read, args=job) for job in work[1:]]
        for t in threads:
            t.start()
        if work:
            read(*work[0])
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_item(self, f: Any, item: Any, planner: LoadPlanner) -> None:
        info: _StorageInfo = self.storage_data[item.storage_index]
        if item.type == LoadItemType.BYTE_IO:  # DCP's planner would unpickle it: never
            raise CheckpointError(
                f"checkpoint entry {item.storage_index.fqn} is a pickled object (DCP BYTE_IO), "
                "which varuna_fx never writes and does not unpickle: the checkpoint was "
                "tampered with or not written by varuna_fx")
        meta = self.tensors[item.storage_index.fqn]
        assert isinstance(meta, TensorStorageMetadata)
        dtype = meta.properties.dtype
        sizes = _chunk_sizes(meta, item.storage_index)
        target = planner.resolve_tensor(item).detach()
        whole = all(o == 0 for o in item.storage_offsets) and \
            tuple(item.lengths) == tuple(sizes)
        if whole and target.device.type == "cpu" and target.dtype == dtype \
                and target.is_contiguous() and tuple(target.shape) == tuple(sizes):
            _read_into(f, info.offset, info.length, target)
            self._check(info, target, item, meta, sizes)
        else:  # a slice, another dtype or device: via a temporary, as DCP's reader does
            stored = torch.empty(sizes, dtype=dtype)
            _read_into(f, info.offset, info.length, stored)
            self._check(info, stored, item, meta, sizes)
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                stored = stored.narrow(dim, start, length)
            if tuple(target.shape) != tuple(stored.shape):
                raise AssertionError(f"{item.storage_index}: stored {tuple(stored.shape)}, "
                                     f"destination {tuple(target.shape)}")
            target.copy_(stored)
        planner.commit_tensor(item, target)

    def _check(self, info: _StorageInfo, tensor: torch.Tensor, item: Any,
               meta: TensorStorageMetadata, sizes: tuple[int, ...]) -> None:
        crc = getattr(info, "crc32", None)
        bound = getattr(info, "bound", False)
        where = os.path.join(self.path, info.relative_path)
        fqn = item.storage_index.fqn
        if crc is None or (self.bound and bound is not True):
            if self.verify:
                raise CheckpointError(
                    f"{where}: entry {fqn} has no checksum{' bound to its name' * self.bound}, "
                    "which every entry of this checkpoint format has: its metadata was "
                    "tampered with")
            return
        start = 0
        if bound:
            start = zlib.crc32(entry_header(fqn, item.storage_index.offset, meta.size, sizes,
                                            meta.properties.dtype, info.relative_path,
                                            info.offset, info.length))
        if zlib.crc32(byte_view(tensor), start) != crc:
            raise CheckpointError(
                f"{where}: the bytes of {fqn} (offset {info.offset}, {info.length} bytes) do "
                "not match the checksum written with them for this entry: the file is damaged "
                "(a bit flip, a partial copy) or the metadata names another entry's bytes (its "
                "entries were swapped or edited): load an earlier checkpoint, or copy this one "
                "again")


def _balance(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Items into ``bins`` files of about equal bytes (largest first)."""
    bins = min(bins, max(1, len(items)))
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    for item in sorted(items, key=_size, reverse=True):
        i = sizes.index(min(sizes))
        buckets[i].append(item)
        sizes[i] += _size(item)
    return buckets


def _size(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    n = 1
    for s in item.tensor_data.size:
        n *= s
    return n * torch._utils._element_size(item.tensor_data.properties.dtype)


def _write_file(path: str, name: str, items: Iterable[WriteItem], planner: SavePlanner,
                sync: bool, checksums: bool) -> list[WriteResult]:
    results = []
    with open(path, "wb", buffering=0) as f:
        offset = 0
        for item in items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                buffer = memoryview(data.getbuffer())
            else:
                tensor = data.detach()
                if tensor.device.type != "cpu":
                    tensor = tensor.cpu()
                buffer = byte_view(tensor.contiguous())
            _write_all(f, buffer)
            crc = None
            if checksums:  # zlib releases the GIL
                crc = zlib.crc32(buffer, zlib.crc32(_header(item, name, offset, len(buffer))))
            results.append(WriteResult(index=item.index, size_in_bytes=len(buffer),
                                       storage_data=ChecksummedInfo(name, offset, len(buffer),
                                                                    crc32=crc,
                                                                    bound=checksums)))
            offset += len(buffer)
        if sync:
            os.fsync(f.fileno())
    return results


def _header(item: WriteItem, name: str, offset: int, length: int) -> bytes:
    data = item.tensor_data
    if data is None:  # (varuna_fx writes only tensors; a load refuses anything else unread)
        return entry_header(item.index.fqn, (), (), (), "bytes", name, offset, length)
    return entry_header(item.index.fqn, item.index.offset, data.size, data.chunk.sizes,
                        data.properties.dtype, name, offset, length)


def _write_all(f: Any, buffer: memoryview) -> None:
    view = buffer
    while len(view):
        written = f.write(view[:CHUNK])
        view = view[written:]


def _read_into(f: Any, offset: int, length: int, tensor: torch.Tensor) -> None:
    view = byte_view(tensor)
    if len(view) != length:
        raise AssertionError(f"stored {length} bytes, destination holds {len(view)}")
    _fill(f, offset, view)


def _fill(f: Any, offset: int, view: memoryview) -> None:
    f.seek(offset)
    while len(view):
        n = f.readinto(view[:CHUNK])
        if not n:
            raise OSError(f"{f.name}: file ends before the entry at offset {offset} does")
        view = view[n:]


def _chunk_sizes(meta: TensorStorageMetadata, index: Any) -> tuple[int, ...]:
    """The shape of the stored chunk ``index`` names (a whole tensor: its shape)."""
    chunks = meta.chunks
    hint = index.index
    if hint is not None and hint < len(chunks) and \
            tuple(chunks[hint].offsets) == tuple(index.offset):
        return tuple(chunks[hint].sizes)
    for chunk in chunks:
        if tuple(chunk.offsets) == tuple(index.offset):
            return tuple(chunk.sizes)
    raise AssertionError(f"{index}: no such chunk in the checkpoint")
