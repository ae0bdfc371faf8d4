"""Hugging Face safetensors weights into a pipeline, and a pipeline's weights out to them.

:func:`load_pretrained` fills the tensors this process holds (its stages', on any (P, D) and
with virtual stages; every tensor in one process) from a checkpoint directory, reading only
those tensors (``safetensors_files.read_into``): no rank reads or holds the whole model. The
keys are the model's FQNs as transformers names them (``hf_keys.py``). Every rank first checks
the whole checkpoint against the whole model from the files' headers, so a checkpoint that does
not fit raises the same :class:`PretrainedError` on every rank, naming what is missing,
unexpected or of another shape (and, from config.json, the model type or settings that differ)
before a byte reaches the model. Values are cast into the tensors' own dtype (a bf16 file into
an fp32 model: compile's precisions keep fp32 parameters and autocast). What ``vf.skip_init`` /
``vf.deferred_init`` left unset is marked loaded; a read that fails partway marks what it may
have overwritten, so steps refuse until a load succeeds (``failures.py``).

:func:`save_pretrained` writes transformers' layout: one shard per stage that holds tensors no
earlier stage holds (tied weights and the tensors forward never reads are written once, by the
first stage holding them), each by the rank of replica 0 that runs that stage, then (rank 0,
after every shard is in place) ``config.json``, ``generation_config.json`` and the index.
``transformers.AutoModelForCausalLM.from_pretrained(directory)`` opens the result.

Ranks agree (``agreement.py``, on the checkpoint process group, with its timeout) on the path,
then after every phase, so one rank's failure raises on all of them instead of leaving the
others waiting. These are plain functions of a pipeline, for ``Pipeline`` and the train command.
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import PretrainedError
from ...init.skip import loaded
from ..checkpointable import Checkpointable
from ..contents import few
from ..directory import lock, unlock
from ..failures import FailedLoad, mark_failed
from ..save_load import Checkpointer
from .keys import config_differences, match_keys, saved_names
from .safetensors_files import (
    CONFIG,
    INDEX,
    PARTIAL,
    Checkpoint,
    open_checkpoint,
    read_into,
    read_json,
    same_values,
    shard_name,
    stale_weights,
    write_file,
    write_index,
)


@dataclass(frozen=True)
class PretrainedLoad:
    """What :func:`load_pretrained` did here: the keys it read into this process's tensors and
    their bytes on disk, and (``strict=False``) what it left out."""

    read: list[str]  # checkpoint keys read by this process
    bytes_read: int
    missing: list[str]  # the model's tensors no key filled (they keep their values)
    unexpected: list[str]  # checkpoint keys naming nothing of the model (not read)


def load_pretrained(pipe: Checkpointable, ckpt: Checkpointer, path: str, *,
                    strict: bool = True) -> PretrainedLoad | FailedLoad:
    """Load the Hugging Face checkpoint at ``path`` into the tensors ``pipe`` holds here
    (``ckpt``: the pipeline's checkpointer, for its agreement between ranks). A failure before
    the first byte raises on every rank; one after it marks the tensors and returns the
    :class:`FailedLoad` for the pipeline to keep and raise."""
    path = os.path.normpath(os.fspath(path))
    ckpt.wait()  # a save in flight uses the same process group
    ckpt.agreement.same_call("load_pretrained", path, None, True)
    held = pipe.state_dict()
    error: BaseException | None = None
    plan: list[tuple[str, Any, torch.Tensor]] = []
    result = PretrainedLoad([], 0, [], [])
    try:
        plan, result = _plan_load(pipe, path, held, strict)
    except PretrainedError as exc:
        error = exc
    ckpt.agreement.agree(error, f"checking {path}")
    filled: list[torch.Tensor] = []
    failed: FailedLoad | None = None
    try:  # from the first byte copied, a failure leaves the model partly overwritten
        filled.extend(read_into(plan))
    except Exception as exc:  # noqa: BLE001 - every failure becomes the error users read
        error = PretrainedError(f"reading {path} failed partway ({type(exc).__name__}: "
                                f"{exc}); its files are damaged or changed while read: load "
                                "it again, or a copy")
        error.__cause__ = exc
        failed = mark_failed([t for _, _, t in plan], path, error, call="load_pretrained")
    try:
        ckpt.agreement.agree(error, f"reading {path}")
    except BaseException as agreed:
        if failed is None:  # another rank's read failed; this rank's tensors are whole
            raise
        failed.error = agreed
        return failed
    loaded(filled)  # clears what vf.skip_init / vf.deferred_init left unset
    return result


def _plan_load(pipe: Checkpointable, path: str, held: dict[str, torch.Tensor],
               strict: bool) -> tuple[list[tuple[str, Any, torch.Tensor]], PretrainedLoad]:
    """Check the whole checkpoint against the whole model; what this process reads, into what."""
    meta = [n for n, t in held.items() if t.is_meta]
    if meta:
        raise PretrainedError(
            f"the pipeline's tensors are on the meta device ({few(meta)}): a pipeline compiled "
            "from a meta model only plans. Build the model under `with vf.deferred_init(seed="
            "0):` (compile then allocates each stage's tensors where it runs) and load into "
            "that pipeline")
    checkpoint = open_checkpoint(path)
    found = match_keys(pipe.model, pipe.state_layout, checkpoint.entries)
    kind, settings = _config_check(pipe.model, checkpoint)
    refused = found.mismatched or (strict and (found.missing or found.unexpected))
    if refused:
        raise _mismatch(pipe.model, path, found, kind, settings, strict)
    if kind is not None:
        warnings.warn(f"{path} is a checkpoint of another model type ({kind}); every tensor "
                      "fits by name and shape, so it was loaded", stacklevel=4)
    if found.dropped:
        warnings.warn(f"{path} holds a head the base model {type(pipe.model).__name__} does not "
                      f"have; its {len(found.dropped)} tensor(s) were not read: "
                      f"{few(found.dropped)}", stacklevel=4)
    plan = [(found.source[n], checkpoint.entries[found.source[n]], t)
            for n, t in held.items() if n in found.source]
    _warn_untied(path, found, checkpoint, held)
    size = sum(e.nbytes for _, e, _ in plan)
    return plan, PretrainedLoad([k for k, _, _ in plan], size, found.missing, found.unexpected)


def _warn_untied(path: str, found: Any, checkpoint: Checkpoint,
                 held: dict[str, torch.Tensor]) -> None:
    """A tied weight (one tensor of the model under several names) that the checkpoint holds
    under two of its names with different values: transformers warns and unties them; the
    traced model keeps one tensor, so the canonical name's values are kept, and said so. Only
    the tensors this process reads are compared (a rank reads its own share only)."""
    for name, others in found.also.items():
        if name not in held:
            continue
        kept = found.source[name]
        differ = [k for k in others if not same_values(
            (kept, checkpoint.entries[kept]), (k, checkpoint.entries[k]))]
        if differ:
            warnings.warn(
                f"{path} holds the tied weight {name} under {len(differ) + 1} names with "
                f"different values: {kept} and {', '.join(differ)}. The model ties them (one "
                f"tensor), so it cannot hold both: kept {kept}, ignored {', '.join(differ)} "
                "(transformers unties them instead). If the checkpoint's model does not tie "
                "them, build the model untied (e.g. config tie_word_embeddings=False)",
                stacklevel=4)


def _config_check(model: Any, checkpoint: Checkpoint) -> tuple[str | None, list[str]]:
    if checkpoint.directory is None:
        return None, []
    config = os.path.join(checkpoint.directory, CONFIG)
    if not os.path.isfile(config):
        return None, []
    return config_differences(model, read_json(config))


def _mismatch(model: Any, path: str, found: Any, kind: str | None, settings: list[str],
              strict: bool) -> PretrainedError:
    """The refusal: the first difference first, then every list, then what to do."""
    name = type(model).__name__
    parts = []
    if kind is not None:
        parts.append(f"another model type ({kind})")
    elif settings:
        parts.append(f"other settings in its config.json ({few(settings, 3)})")
    if found.mismatched:
        parts.append(f"{len(found.mismatched)} tensor(s) of another shape or dtype: "
                     f"{few(found.mismatched, 3)}")
    if found.missing and strict:
        parts.append(f"{len(found.missing)} of the model's tensor(s) missing: "
                     f"{few(found.missing)}")
    if found.unexpected and strict:
        parts.append(f"{len(found.unexpected)} tensor(s) the model does not have: "
                     f"{few(found.unexpected)}")
    advice = "Load a checkpoint of this architecture and size"
    if not found.mismatched:
        advice += (", or pass strict=False to load the tensors that fit (the missing ones "
                   "keep their values)")
    return PretrainedError(
        f"{path} does not fit {name}: {'; '.join(parts)}. {advice}.",
        missing=found.missing, unexpected=found.unexpected, mismatched=found.mismatched)


# -- saving ----------------------------------------------------------------------------------


def save_pretrained(pipe: Checkpointable, ckpt: Checkpointer, directory: str) -> None:
    """Write the pipeline's weights to ``directory`` in transformers' layout, every rank of
    replica 0 its stages' shards (``ckpt``: the pipeline's checkpointer, for its agreement)."""
    directory = os.path.normpath(os.fspath(directory))  # the lock goes beside it, not inside
    ckpt.wait()  # a save in flight uses the same process group
    ckpt.agreement.same_call("save_pretrained", directory, None, True)
    layout, names = pipe.state_layout, saved_names(pipe.model, pipe.state_layout)
    shards = _shards(pipe)
    files = {s: shard_name(i + 1, len(shards)) for i, s in enumerate(shards)}
    mine = [s for s in pipe.local_stages if s in shards] if pipe.replica_index == 0 else []
    held = pipe.state_dict() if mine else {}
    error: BaseException | None = None
    fd = None
    if ckpt.rank == 0:
        try:
            if os.path.exists(directory) and not os.path.isdir(directory):
                raise PretrainedError(f"{directory} is a file: save_pretrained writes a "
                                      "directory; pass a directory path")
            os.makedirs(directory, exist_ok=True)
            fd = lock(directory)  # one job at a time writes here
            # an earlier index goes first: it would pair its names with the new shards
            if os.path.exists(os.path.join(directory, INDEX)):
                os.remove(os.path.join(directory, INDEX))
        except (OSError, PretrainedError) as exc:
            error = _storage(exc, directory, "preparing")
    try:
        ckpt.agreement.agree(error, f"preparing {directory}")
        written = []
        try:
            for s in mine:
                final = os.path.join(directory, files[s])
                write_file(final + PARTIAL, {names[n]: held[n] for n in shards[s]})
                written.append(final)
            for final in written:  # every byte is on disk before any name appears
                os.replace(final + PARTIAL, final)
        except (OSError, RuntimeError, ValueError, PretrainedError) as exc:
            error = _storage(exc, directory, "writing")
            for final in written:
                for leftover in (final + PARTIAL, final):
                    if os.path.exists(leftover):
                        os.remove(leftover)
        ckpt.agreement.agree(error, f"writing {directory}")
        if ckpt.rank == 0:
            try:
                weight_map = {names[n]: files[s] for s, group in shards.items() for n in group}
                size = sum(_tensor_bytes(layout, n) for group in shards.values() for n in group)
                _write_configs(pipe.model, directory, layout)
                if len(shards) > 1:
                    write_index(directory, weight_map, size)
                keep = set(files.values()) | ({INDEX} if len(shards) > 1 else set())
                for old in stale_weights(directory, keep):
                    os.remove(os.path.join(directory, old))
            except (OSError, PretrainedError) as exc:
                error = _storage(exc, directory, "completing")
        ckpt.agreement.agree(error, f"completing {directory}")
    finally:
        if fd is not None:
            unlock(directory, fd)


def _shards(pipe: Checkpointable) -> dict[int, list[str]]:
    """stage -> the canonical names it writes (model order): those no earlier stage holds.
    The same on every rank: it depends on the plan only."""
    layout = pipe.state_layout
    state = set(layout.names)
    seen: set[str] = set()
    shards = {}
    for s in range(len(pipe.stages)):
        names = [n for n in layout.held_names(pipe.canonical, pipe.stages, [s])
                 if n in state and n not in seen]
        seen.update(names)
        if names:
            shards[s] = names
    return shards


def _tensor_bytes(layout: Any, name: str) -> int:
    return math.prod(layout.shapes[name]) * layout.dtypes[name].itemsize


def _write_configs(model: Any, directory: str, layout: Any) -> None:
    """The model's transformers config (and generation config) beside the weights, as
    ``PreTrainedModel.save_pretrained`` writes them: the class under ``architectures``, the
    weights' dtype. Models without a ``.config`` get the weights alone."""
    config = getattr(model, "config", None)
    if config is not None and (hasattr(config, "save_pretrained")
                               or hasattr(config, "to_json_file")):
        config = copy.deepcopy(config)  # the model's own config stays as it is
        floats = [d for d in layout.dtypes.values() if d.is_floating_point]
        if floats:
            field = "dtype" if "dtype" in config.to_dict() else "torch_dtype"
            setattr(config, field, str(floats[0]).removeprefix("torch."))
        config.architectures = [type(model).__name__]
        if hasattr(config, "save_pretrained"):
            config.save_pretrained(directory)
        else:
            config.to_json_file(os.path.join(directory, CONFIG))
    can_generate = getattr(model, "can_generate", None)
    generation = getattr(model, "generation_config", None)
    if callable(can_generate) and can_generate() and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(directory)


def _storage(exc: BaseException, directory: str, doing: str) -> PretrainedError:
    if isinstance(exc, PretrainedError):
        return exc
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        return PretrainedError(f"{doing} {directory} failed: {exc.strerror or exc}{where}; "
                               "check that the disk has space and the directory is writable")
    return PretrainedError(f"{doing} {directory} failed: {type(exc).__name__}: {exc}")
