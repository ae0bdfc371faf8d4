"""Layout-independent checkpoints on torch.distributed.checkpoint (DCP).

A checkpoint is a directory DCP wrote, plus a marker file. Every key is named by the original
model's FQNs, never by stage or rank, so it loads under any (P, D, micro-batch size, schedule):

* ``model/<fqn>``: every parameter and persistent buffer (tied ones once, ones forward never
  reads included). Each rank passes only the tensors it holds; DCP writes a tensor several ranks
  hold (replicas, tied copies) once. No rank gathers the model.
* ``optim/<fqn>/<key>`` and ``obj/optim/<fqn>``: optimizer state (``optimizer_state.py``).
* ``obj/meta`` (rank 0): loss scale, the RNG state the step seeds are drawn from, the user's
  ``extra`` dict.

Storage: DCP plans, deduplicates and records metadata; the bytes are written raw, one file per
writer thread and rank, and read straight into the destination tensors (``raw_storage.py``,
format 2; format-1 checkpoints, DCP's own ``torch.save`` records, still load). In one process
DCP's steps run without ``torch.distributed`` (``dcp_local.py``).

Atomic: DCP writes into ``<path>.partial``; when every rank is done, rank 0 writes the marker and
renames the directory to ``<path>``. A kill at any moment leaves at most a ``.partial``
directory, which :func:`latest_checkpoint` skips with a warning, and every earlier checkpoint
untouched. ``async_save=True`` copies the state to host memory, returns a
:class:`SaveHandle` and writes (and renames) in a background thread on its own process group,
so training continues meanwhile; the next save, a load or ``pipe.close()`` waits for it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from ..errors import CheckpointError
from ..init.skip import loaded
from ..world.where import launched_distributed, resolve_timeout
from . import dcp_local
from .optimizer_state import (
    decode,
    encode,
    optimizer_entries,
    parameter_fqns,
    restore_optimizer,
    wanted_keys,
)
from .raw_storage import RawReader, RawWriter

# 2: tensors stored as raw bytes (raw_storage.py); 1: DCP's torch.save records (still read)
FORMAT = 2
READABLE = (1, 2)
MARKER = "varuna_fx_checkpoint.json"
WRITE_THREADS = 4
PARTIAL = ".partial"
MODEL = "model/"
META = "obj/meta"


class SaveHandle:
    """An asynchronous save in flight: ``result()`` waits until the checkpoint is complete
    (renamed into place on every rank) and returns its path, or raises what went wrong."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._future: Future[str] = Future()

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> str:
        return self._future.result(timeout)


class Checkpointer:
    """Per pipeline: the process group checkpoints use (separate from training's, so an
    asynchronous save's collectives never interleave with a step's) and the save in flight."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.distributed = launched_distributed() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.timeout = getattr(pipe.runtime, "timeout", None) or resolve_timeout(None)
        self.group = None
        if self.distributed:  # collective: every rank's first save/load gets here together
            from datetime import timedelta

            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))
        self.pending: SaveHandle | None = None

    # -- saving --------------------------------------------------------------------------------

    def save(self, path: str, optimizer: torch.optim.Optimizer | None,
             extra: dict[str, Any] | None, *, async_save: bool = False) -> SaveHandle | None:
        self.wait()
        path = os.path.normpath(path)
        marker = {"format": FORMAT, "byteorder": sys.byteorder,
                  "model": self.pipe.plan.model_name,
                  "optimizer": _class_name(optimizer) if optimizer is not None else None,
                  "plan": _layout_summary(self.pipe), "world": self.world}
        # a bad argument may show on one rank only (extra is rank 0's): every rank must learn
        # of it before the collective save, or the others would wait for that rank in vain
        state: dict[str, torch.Tensor] = {}
        error: BaseException | None = None
        try:
            state = self._state(optimizer, extra)
        except CheckpointError as exc:
            error = exc
        if error is None and self.rank == 0:
            error = _try(lambda: _prepare(path))
        self._agree(error, f"preparing {path}")
        # several writer threads (one file each): writing and fsync are I/O-bound, and
        # several files in flight keep the disk's queue full
        writer = RawWriter(path + PARTIAL, thread_count=WRITE_THREADS)
        planner = DefaultSavePlanner(flatten_state_dict=False)
        if not async_save:
            if self.distributed:
                dcp.save(state, storage_writer=writer, planner=planner, process_group=self.group)
            else:
                dcp_local.save(state, writer, planner)
            self._finish(path, marker)
            return None
        handle = SaveHandle(path)
        if self.distributed:  # returns once `state` is copied to host memory
            written = dcp.async_save(state, storage_writer=writer, planner=planner,
                                     process_group=self.group)
        else:
            staged = writer.stage(state)  # the copy to host memory: all a caller waits for
            written = _in_thread(lambda: dcp_local.save(staged, writer, planner))

        def finish(done: Future) -> None:  # on the writer thread
            try:
                done.result()
                self._finish(path, marker)
                handle._future.set_result(path)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                handle._future.set_exception(exc)

        written.add_done_callback(finish)
        self.pending = handle
        return handle

    def _state(self, optimizer: torch.optim.Optimizer | None,
               extra: dict[str, Any] | None) -> dict[str, torch.Tensor]:
        state = {MODEL + n: t.detach() for n, t in self.pipe.state_dict().items()}
        if optimizer is not None:
            state.update(optimizer_entries(optimizer, self._names()))
        if extra is not None and not isinstance(extra, dict):
            raise CheckpointError(f"extra must be a dict, got {type(extra).__name__}")
        if self.rank == 0:
            scaler = self.pipe.runtime.scaler
            meta = {"extra": extra or {}, "loss_scale": scaler.scale if scaler.enabled else None,
                    "clean_steps": scaler._clean_steps, "rng": _rng_state()}
            state[META] = encode(meta)
            try:
                decode(state[META])
            except Exception as exc:
                raise CheckpointError(
                    "extra must hold plain data (numbers, strings, lists, dicts, tensors) so a "
                    f"checkpoint never runs code when loaded: {str(exc).splitlines()[0]}"
                ) from exc
        return state

    def _finish(self, path: str, marker: dict[str, Any]) -> None:
        """Every rank has written its shard (DCP's save returned): mark complete, rename."""
        error = None
        if self.rank == 0:
            error = _try(lambda: _commit(path, {**marker, "saved_at_ns": time.time_ns()}))
        self._agree(error, f"completing {path}")

    def wait(self) -> None:
        """Wait for the asynchronous save in flight, if any (raises its error)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    # -- loading -------------------------------------------------------------------------------

    def load(self, path: str, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        self.wait()
        path = os.path.normpath(path)
        dest: dict[str, torch.Tensor] = {}
        reader: Any = None
        metadata: Any = None
        error: BaseException | None = None
        try:  # every rank checks; one rank's failure stops all before the collective load
            reader, metadata, dest = self._destinations(path, optimizer)
        except CheckpointError as exc:
            error = exc
        self._agree(error, f"checking {path}")
        planner = DefaultLoadPlanner(flatten_state_dict=False, allow_partial_load=True)
        try:
            if self.distributed:  # DCP gathers a failure to every rank: all raise
                dcp.load(dest, storage_reader=reader, planner=planner, process_group=self.group)
            else:
                dcp_local.load(dest, reader, planner, metadata)
        except (OSError, CheckpointException) as exc:  # a data file missing or cut short
            raise CheckpointError(
                f"{path}: reading its tensors failed ({exc}); the checkpoint's files are "
                "damaged or incomplete: load an earlier checkpoint, or copy this one again"
            ) from exc
        loaded(self.pipe.state_dict().values())  # clears what vf.skip_init left unset
        if optimizer is not None:
            restore_optimizer(optimizer, self._names(), dest)
        meta = decode(dest[META])
        scaler = self.pipe.runtime.scaler
        if scaler.enabled and meta["loss_scale"] is not None:  # fp16 saved and fp16 now
            scaler.scale, scaler._clean_steps = meta["loss_scale"], meta["clean_steps"]
        _set_rng_state(meta["rng"])
        return meta["extra"]

    # -- helpers -------------------------------------------------------------------------------

    def _destinations(self, path: str, optimizer: torch.optim.Optimizer | None
                      ) -> tuple[Any, Any, dict[str, torch.Tensor]]:
        """Check ``path`` against this model and optimizer; its reader, its DCP metadata and
        the tensors to load into."""
        marker = read_marker(path)
        reader = RawReader(path) if marker["format"] == 2 else FileSystemReader(path)
        try:
            full = reader.read_metadata()
        except Exception as exc:
            raise CheckpointError(f"{path}: DCP metadata unreadable ({exc})") from exc
        metadata = full.state_dict_metadata
        _check_model(self.pipe.state_layout, metadata, path)
        held = self.pipe.state_dict()
        keys = [MODEL + n for n in held] + [META]
        if optimizer is not None:
            if marker.get("optimizer") is None:
                raise CheckpointError(
                    f"{path} holds no optimizer state, but an optimizer was passed: load "
                    "without optimizer=, or from a checkpoint saved with one"
                )
            if marker["optimizer"] != _class_name(optimizer):
                raise CheckpointError(
                    f"{path} holds state of a {marker['optimizer']}, not of the "
                    f"{_class_name(optimizer)} passed: use the same optimizer class"
                )
            keys += wanted_keys(parameter_fqns(optimizer, self._names()), list(metadata))
        elif marker.get("optimizer") is not None:
            warnings.warn(f"{path} holds {marker['optimizer']} state but no optimizer was "
                          "passed to load_checkpoint: the optimizer starts fresh", stacklevel=4)
        # the model's own tensors are the destinations (DCP copies into them, casting as
        # needed): no second copy of the model in memory
        dest = {k: torch.empty(metadata[k].size, dtype=metadata[k].properties.dtype)
                for k in keys if not k.startswith(MODEL)}
        dest.update({MODEL + n: t.detach() for n, t in held.items()})
        return reader, full, dest

    def _names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.pipe.named_parameters()}

    def _agree(self, error: BaseException | None, what: str) -> None:
        """A barrier that also tells every rank whether any rank failed (and raises there)."""
        if not self.distributed:
            if error is not None:
                raise error
            return
        messages: list[Any] = [None] * self.world
        dist.all_gather_object(messages, None if error is None else str(error), self.group)
        if error is not None:
            raise error
        failed = [(r, m) for r, m in enumerate(messages) if m is not None]
        if failed:
            rank, message = failed[0]
            raise CheckpointError(f"rank {rank} failed {what}: {message}")

    def close(self) -> None:
        self.wait()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


def checkpointer(pipe: Any) -> Checkpointer:
    found = getattr(pipe, "_checkpointer", None)
    if found is None:
        found = pipe._checkpointer = Checkpointer(pipe)
    return found


def wait_for_saves(pipe: Any) -> None:
    """Complete an asynchronous save in flight and release the checkpoint process group."""
    found = getattr(pipe, "_checkpointer", None)
    if found is not None:
        found.close()
        pipe._checkpointer = None


def latest_checkpoint(directory: str | os.PathLike) -> str | None:
    """The newest complete checkpoint directly under ``directory`` (by the time it completed),
    or None. Directories a killed save left behind are skipped with a warning."""
    root = Path(directory)
    if not root.is_dir():
        return None
    complete: list[tuple[int, str]] = []
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        if entry.name.endswith(PARTIAL) or (
                not (entry / MARKER).exists() and (entry / ".metadata").exists()):
            warnings.warn(f"skipping incomplete checkpoint {entry} (its save was interrupted)",
                          stacklevel=2)
            continue
        try:
            marker = json.loads((entry / MARKER).read_text())
        except (OSError, ValueError):
            continue  # not a checkpoint
        complete.append((int(marker.get("saved_at_ns", 0)), str(entry)))
    return max(complete)[1] if complete else None


def read_marker(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a checkpoint: no such directory")
    try:
        with open(os.path.join(path, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is not a complete varuna_fx checkpoint (no valid {MARKER}): pass a "
            "directory pipe.save_checkpoint wrote, e.g. vf.latest_checkpoint(dir)"
        ) from exc
    if marker.get("format") not in READABLE:
        raise CheckpointError(f"{path} has checkpoint format {marker.get('format')}; this "
                              f"varuna_fx reads formats {', '.join(map(str, READABLE))}")
    if marker["format"] == 2 and marker.get("byteorder", sys.byteorder) != sys.byteorder:
        raise CheckpointError(f"{path} was written on a {marker['byteorder']}-endian machine; "
                              f"its raw tensor bytes cannot be read on this {sys.byteorder}-"
                              "endian one")
    return marker


def _check_model(layout: Any, metadata: dict[str, Any], path: str) -> None:
    """Refuse a checkpoint of another model, naming what differs."""
    saved = {k[len(MODEL):]: tuple(v.size) for k, v in metadata.items() if k.startswith(MODEL)}
    missing = [n for n in layout.names if n not in saved]
    unexpected = [n for n in saved if n not in layout.shapes]
    shapes = [f"{n} {saved[n]} saved, {layout.shapes[n]} now" for n in layout.names
              if n in saved and saved[n] != layout.shapes[n]]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {_few(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)}: {_few(unexpected)}")
        if shapes:
            parts.append(f"shape mismatches: {_few(shapes)}")
        raise CheckpointError(f"{path} is a checkpoint of another model ({'; '.join(parts)})")


def _prepare(path: str) -> None:
    """Rank 0, before a save: a stale ``.partial`` (a killed save) goes; the destination must
    be free or a checkpoint (which the new one replaces)."""
    if os.path.exists(path) and not os.path.exists(os.path.join(path, MARKER)):
        raise CheckpointError(f"{path} exists and is not a checkpoint: refusing to overwrite it")
    if os.path.exists(path + PARTIAL):
        shutil.rmtree(path + PARTIAL)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def _commit(path: str, marker: dict[str, Any]) -> None:
    partial = path + PARTIAL
    with open(os.path.join(partial, MARKER), "w") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    old = None
    if os.path.exists(path):  # replacing a checkpoint: never leave neither in place
        old = f"{path}.old-{os.getpid()}"
        os.rename(path, old)
    os.rename(partial, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _in_thread(fn: Any) -> Future:
    """Run ``fn`` on a new thread; its result or exception arrives in the returned future.
    Not a daemon: the interpreter waits for a checkpoint being written before it exits."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            future.set_exception(exc)

    threading.Thread(target=run, name="varuna_fx checkpoint writer").start()
    return future


def _try(fn: Any) -> BaseException | None:
    try:
        fn()
    except (OSError, CheckpointError) as exc:
        return exc if isinstance(exc, CheckpointError) else CheckpointError(str(exc))
    return None


def _rng_state() -> dict[str, Any]:
    """The generators step seeds (dropout) are drawn from: rank 0's, restored on every rank."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available() and \
            len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _class_name(optimizer: torch.optim.Optimizer) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _layout_summary(pipe: Any) -> dict[str, Any]:
    plan = pipe.plan
    return {"stages": plan.stages, "data_parallel": plan.data_parallel,
            "micro_batch_size": plan.micro_batch_size, "schedule": plan.schedule.name}


def _few(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
