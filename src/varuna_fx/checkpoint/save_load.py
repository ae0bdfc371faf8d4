"""Layout-independent checkpoints on torch.distributed.checkpoint (DCP).

A checkpoint is a directory DCP wrote, plus a marker file. Every key is named by the original
model's FQNs, never by stage or rank, so it loads under any (P, D, micro-batch size, schedule):

* ``model/<fqn>``: every parameter and persistent buffer (tied ones once, ones forward never
  reads included). Each rank passes only the tensors it holds; DCP writes a tensor several ranks
  hold (replicas, tied copies) once. No rank gathers the model.
* ``optim/<fqn>/<key>`` and ``obj/optim/<fqn>``: optimizer state (``optimizer_state.py``).
* ``obj/meta`` (rank 0): loss scale, the RNG state the step seeds are drawn from, the user's
  ``extra`` dict (``contents.py``).

Storage: DCP plans, deduplicates and records metadata; the bytes are written raw, one file per
writer thread and rank, with a CRC-32 per entry bound to its name, and read straight into the
destination tensors, verified (``raw_storage.py``, format 4; formats 3, 2 and 1 still load).
The metadata is read without running code and pickled entries are refused
(``safe_metadata.py``). In one process DCP's steps run without ``torch.distributed``
(``dcp_local.py``).

Before anything is written or read the ranks agree (``agreement.py``): the same path and
optimizer class on every rank, then every rank's checks passed -- else every rank raises. A
load that fails once bytes reach the model marks the model and returns the refusal the pipeline
keeps until a load succeeds (``failures.py``).

The pipeline is read through :class:`Checkpointable` (``checkpointable.py``); it owns its
:class:`Checkpointer` and nothing here writes onto it.

Atomic (``directory.py``): DCP writes into ``<path>.partial``; when every rank is done, rank 0
writes the marker and renames the directory to ``<path>``. ``async_save=True`` copies the state to host memory, returns a
:class:`SaveHandle` (``background.py``) and writes (and renames) in a background thread on its own process group,
so training continues meanwhile; the next save, a load or ``pipe.close()`` waits for it.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..errors import CheckpointError
from ..init.skip import loaded
from ..world.where import launched_distributed, resolve_timeout
from . import dcp_local, stateful, sync_state
from .agreement import Agreement
from .background import SaveHandle, in_thread
from .checkpointable import Checkpointable
from .contents import (
    META,
    MODEL,
    check_plain,
    check_same_model,
    class_name,
    few,
    layout_summary,
    rng_state,
    set_rng_state,
)
from .directory import FORMAT, PARTIAL, commit, discard, prepare, read_marker, unlock
from .failures import FailedLoad, load_error, mark_failed, storage_error
from .optimizer_state import (
    decode,
    encode,
    optimizer_entries,
    parameter_fqns,
    restore_optimizer,
    wanted_keys,
)
from .raw_storage import RawReader, RawWriter
from .safe_metadata import LegacyReader, SafeLoadPlanner

WRITE_THREADS = 4


class Checkpointer:
    """Per pipeline (``Pipeline._checkpointer``, made at its first save or load): the process
    group checkpoints use (separate from training's, so an asynchronous save's collectives never
    interleave with a step's) and the save in flight."""

    def __init__(self, pipe: Checkpointable) -> None:
        self.pipe = pipe
        self.distributed = launched_distributed() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.timeout = pipe.runtime.timeout or resolve_timeout(None)
        self.group = None
        if self.distributed:  # collective: every rank's first save/load gets here together
            from datetime import timedelta

            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))
        self.agreement = Agreement(self.group, self.rank, self.world)
        self.pending: SaveHandle | None = None
        self.lock: int | None = None  # rank 0, while saving: the path's lock (directory.py)

    # -- saving --------------------------------------------------------------------------------

    def save(self, path: str, optimizer: torch.optim.Optimizer | None,
             extra: dict[str, Any] | None, *, async_save: bool = False,
             states: dict[str, Any] | None = None) -> SaveHandle | None:
        """``states``: ``stateful.collect``'s arguments (data=, scheduler=, stateful=)."""
        self.wait()
        path = os.path.normpath(path)
        kind = class_name(optimizer) if optimizer is not None else None
        self.agreement.same_call("save_checkpoint", path, kind, self._holds_parameters())
        marker = {"format": FORMAT, "byteorder": sys.byteorder,
                  "model": self.pipe.plan.model_name, "optimizer": kind,
                  "plan": layout_summary(self.pipe.plan), "world": self.world}
        # a bad argument may show on one rank only (extra is rank 0's): every rank must learn
        # of it before the collective save, or the others would wait for that rank in vain
        state: dict[str, torch.Tensor] = {}
        digests: dict[str, str] = {}
        error: BaseException | None = None
        try:
            state = self._state(optimizer, extra)
            saved, digests = stateful.entries(stateful.collect(**(states or {})))
            if self.rank == 0:  # one copy (check_same: every rank's is the same)
                state.update(saved)
        except CheckpointError as exc:
            error = exc
        if error is None and self.rank == 0:
            try:
                self.lock = prepare(path)
            except (OSError, CheckpointError) as exc:
                error = storage_error(exc, path, "preparing")
        writer: Any = None
        try:
            stateful.check_same(self.agreement.agree(error, f"preparing {path}", digests))
            try:  # several writer threads (one file each) keep the disk's queue full
                writer = RawWriter(path + PARTIAL, thread_count=WRITE_THREADS)
            except OSError as exc:
                error = storage_error(exc, path, "creating")
            self.agreement.agree(error, f"creating {path + PARTIAL}")
        except BaseException:
            self._release(path, failed=True)
            raise
        planner = DefaultSavePlanner(flatten_state_dict=False)
        if not async_save:
            try:
                if self.distributed:
                    dcp.save(state, storage_writer=writer, planner=planner,
                             process_group=self.group)
                else:
                    dcp_local.save(state, writer, planner)
            except BaseException as exc:
                self._release(path, failed=True)
                raise storage_error(exc, path, "writing") from exc
            self._finish(path, marker)
            return None
        handle = SaveHandle(path)
        try:
            if self.distributed:  # returns once `state` is copied to host memory
                written = dcp.async_save(state, storage_writer=writer, planner=planner,
                                         process_group=self.group)
            else:
                staged = writer.stage(state)  # the copy to host memory: all a caller waits for
                written = in_thread(lambda: dcp_local.save(staged, writer, planner))
        except BaseException as exc:
            self._release(path, failed=True)
            raise storage_error(exc, path, "staging") from exc

        def finish(done: Future) -> None:  # on the writer thread
            try:
                try:
                    done.result()
                except BaseException as exc:
                    self._release(path, failed=True)
                    raise storage_error(exc, path, "writing") from exc
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
        sync = sync_state.of(self.pipe)  # replica sync other than exact (sync_state.py)
        if sync is not None:
            state.update(sync.model())
            state.update(sync.entries())
        if optimizer is not None:
            entries = optimizer_entries(optimizer, self._names())
            state.update(entries if sync is None else sync.optimizer(entries))
        if extra is not None and not isinstance(extra, dict):
            raise CheckpointError(f"extra must be a dict, got {type(extra).__name__}")
        if self.rank == 0:
            check_plain(extra or {})
            scaler = self.pipe.runtime.scaler
            scale = scaler.state_dict()
            meta = {"extra": extra or {}, "loss_scale": scale["scale"] if scaler.enabled else None,
                    "clean_steps": scale["clean_steps"], "rng": rng_state()}
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
            try:
                commit(path, {**marker, "saved_at_ns": time.time_ns()})
            except (OSError, CheckpointError) as exc:
                error = storage_error(exc, path, "completing")
            self._release(path, failed=error is not None)
        self.agreement.agree(error, f"completing {path}")

    def _release(self, path: str, failed: bool) -> None:
        """Rank 0: a failed save's ``.partial`` goes (it would hold disk space later saves
        need), then the path's lock."""
        if self.rank != 0 or self.lock is None:
            return
        if failed:
            discard(path)
        unlock(path, self.lock)
        self.lock = None

    def wait(self) -> None:
        """Wait for the asynchronous save in flight, if any (raises its error, unless its
        handle's ``result()`` already raised it)."""
        pending, self.pending = self.pending, None
        if pending is not None and not pending.reported:
            pending.result()

    # -- loading -------------------------------------------------------------------------------

    def load(self, path: str, optimizer: torch.optim.Optimizer | None,
             states: dict[str, Any] | None = None) -> dict[str, Any] | FailedLoad:
        """The ``extra`` dict the checkpoint was saved with. A failure before the first byte
        reaches the model raises; one after it marks the tensors and returns the
        :class:`FailedLoad` (its ``error`` for the caller to raise, the refusal for it to keep).
        ``states``: the data loader, scheduler and other stateful objects to restore."""
        self.wait()
        objects: dict[str, Any] = {}
        path = os.path.normpath(path)
        kind = class_name(optimizer) if optimizer is not None else None
        self.agreement.same_call("load_checkpoint", path, kind, self._holds_parameters())
        dest: dict[str, torch.Tensor] = {}
        reader: Any = None
        metadata: Any = None
        marker: dict[str, Any] = {}
        error: BaseException | None = None
        try:  # every rank checks; one rank's failure stops all before the collective load
            objects = stateful.collect(**(states or {}))
            marker, reader, metadata, dest = self._destinations(path, optimizer, objects)
        except CheckpointError as exc:
            error = exc
        seen = self.agreement.agree(error, f"checking {path}",
                                    (marker.get("sequence"), marker.get("saved_at_ns")))
        if len(set(seen)) > 1:  # replaced by another save between the ranks' reads
            raise CheckpointError(f"{path} changed while the ranks opened it (markers "
                                  f"{seen}): another job is saving to it; load it again")
        planner = SafeLoadPlanner(flatten_state_dict=False, allow_partial_load=True)
        model = [t for k, t in dest.items() if k.startswith(MODEL)]
        try:  # from the first byte read, a failure leaves the model partly overwritten
            if self.distributed:  # DCP gathers a failure to every rank: all raise
                dcp.load(dest, storage_reader=reader, planner=planner, process_group=self.group)
            else:
                dcp_local.load(dest, reader, planner, metadata)
            sync = sync_state.of(self.pipe)
            if optimizer is not None:
                prefix = sync.optimizer_prefix(list(dest)) if sync is not None else ""
                restore_optimizer(optimizer, self._names(), sync_state.strip(prefix, dest))
            if sync is not None:
                sync.restore(dest)
            meta = decode(dest[META])
            if meta["loss_scale"] is not None:  # fp16 saved (and fp16 now: the scaler says)
                self.pipe.runtime.scaler.load_state_dict(
                    {"scale": meta["loss_scale"], "clean_steps": meta["clean_steps"]})
            set_rng_state(meta["rng"])
            extra = meta["extra"]
        except BaseException as exc:
            if not isinstance(exc, Exception | CheckpointException):
                # KeyboardInterrupt and the like: not the checkpoint's fault, but the model
                # may be partly overwritten all the same
                return mark_failed(model, path, exc)
            error = load_error(exc, path)
            error.__cause__, error.__suppress_context__ = exc, True  # `raise error from exc`
            return mark_failed(model, path, error)
        loaded(self.pipe.state_dict().values())  # clears what vf.skip_init left unset
        # last: a state its object refuses (another dataset) leaves the model loaded and usable
        stateful.restore(objects, dest, path)
        return extra

    # -- helpers -------------------------------------------------------------------------------

    def _destinations(self, path: str, optimizer: torch.optim.Optimizer | None,
                      objects: dict[str, Any] | None = None
                      ) -> tuple[dict[str, Any], Any, Any, dict[str, torch.Tensor]]:
        """Check ``path`` against this model and optimizer; its marker, its reader, its DCP
        metadata and the tensors to load into."""
        marker = read_marker(path)
        if marker["format"] >= 2:
            reader = RawReader(path)
            reader.verify = marker["format"] >= 3
            reader.bound = marker["format"] >= 4
        else:
            reader = LegacyReader(path)
        full = reader.read_metadata()  # no code runs (safe_metadata.py)
        metadata = full.state_dict_metadata
        check_same_model(self.pipe.state_layout, metadata, path)
        held = self.pipe.state_dict()
        keys = [MODEL + n for n in held] + [META] + \
            stateful.wanted(objects or {}, list(metadata), path)
        sync = sync_state.of(self.pipe)
        if sync is not None:
            keys += sync.wanted(list(metadata))
        if optimizer is not None:
            if marker.get("optimizer") is None:
                raise CheckpointError(
                    f"{path} holds no optimizer state, but an optimizer was passed: load "
                    "without optimizer=, or from a checkpoint saved with one"
                )
            if marker["optimizer"] != class_name(optimizer):
                raise CheckpointError(
                    f"{path} holds state of a {marker['optimizer']}, not of the "
                    f"{class_name(optimizer)} passed: use the same optimizer class"
                )
            prefix = sync.optimizer_prefix(list(metadata)) if sync is not None else ""
            available = [k[len(prefix):] for k in metadata if k.startswith(prefix)] \
                if prefix else list(metadata)
            keys += [prefix + k for k in wanted_keys(parameter_fqns(optimizer, self._names()),
                                                      available)]
        elif marker.get("optimizer") is not None:
            warnings.warn(f"{path} holds {marker['optimizer']} state but no optimizer was "
                          "passed to load_checkpoint: the optimizer starts fresh", stacklevel=4)
        wrong = [k for k in keys if not isinstance(metadata.get(k), TensorStorageMetadata)]
        if wrong:
            raise CheckpointError(
                f"{path} lacks, or holds other than tensors under, {few(wrong)}: it was "
                "tampered with or not written by varuna_fx; load a checkpoint "
                "pipe.save_checkpoint wrote")
        # the model's own tensors are the destinations (DCP copies into them, casting as
        # needed): no second copy of the model in memory
        dest = {k: torch.empty(metadata[k].size, dtype=metadata[k].properties.dtype)
                for k in keys if not k.startswith(MODEL)}
        dest.update({MODEL + n: t.detach() for n, t in held.items()})
        return marker, reader, full, dest

    def _holds_parameters(self) -> bool:
        return any(True for _ in self.pipe.parameters())

    def _names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.pipe.named_parameters()}

    def close(self) -> None:
        """Complete an asynchronous save in flight and release the checkpoint process group."""
        self.wait()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
