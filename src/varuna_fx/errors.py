"""Errors raised for bad user input.

Every error a user can cause derives from :class:`VarunaFxError` and says what was wrong and
what to change, so callers can catch one type and show the message as it is.
"""

from __future__ import annotations


class VarunaFxError(Exception):
    """Base class of every error caused by the user's model, inputs or configuration."""


class CaptureError(VarunaFxError):
    """The model could not be turned into a graph (data-dependent control flow, ...)."""


class InputError(VarunaFxError):
    """Example or step inputs are malformed (wrong types, batch dims that disagree, ...)."""


class PartitionError(VarunaFxError):
    """No valid partition exists (too many stages, a stage does not fit in memory, ...)."""


class ScheduleError(VarunaFxError):
    """A schedule is incomplete, inconsistent or would deadlock."""


class PlanError(VarunaFxError):
    """No configuration (P, D, micro-batch size) fits the cluster or the batch."""


class DistributedError(VarunaFxError):
    """A distributed run is misconfigured (world size, disagreeing ranks, ...)."""


class PeerTimeoutError(DistributedError):
    """A peer rank did not answer within the timeout."""


class CheckpointError(VarunaFxError):
    """A checkpoint cannot be written or does not fit this model or optimizer."""


class PretrainedError(CheckpointError):
    """A Hugging Face (safetensors) checkpoint cannot be read or written, or its tensors do not
    fit the model. ``missing`` (the model's names no tensor fills), ``unexpected`` (checkpoint
    keys naming nothing of the model) and ``mismatched`` ("name: what the checkpoint holds, what
    the model holds") list them; empty where the error is about something else."""

    def __init__(self, message: str, *, missing: list[str] | None = None,
                 unexpected: list[str] | None = None,
                 mismatched: list[str] | None = None) -> None:
        super().__init__(message)
        self.missing = list(missing or [])
        self.unexpected = list(unexpected or [])
        self.mismatched = list(mismatched or [])


class OptimizerError(VarunaFxError):
    """An optimizer the pipeline cannot step correctly (sharded optimizer state, ZeRO-1)."""


class AllocationError(VarunaFxError):
    """A pipeline cannot allocate its tensors in this process: ``needed`` bytes, ``available``
    bytes (a one-process pipeline of a ``vf.deferred_init`` model bigger than this machine)."""

    def __init__(self, message: str, *, needed: int = 0, available: int = 0) -> None:
        super().__init__(message)
        self.needed, self.available = needed, available


class UninitializedError(VarunaFxError):
    """A tensor ``vf.skip_init()`` left uninitialised was never loaded before a step."""


def env_int(name: str, default: int, minimum: int = 0) -> int:
    """An integer from the launcher's environment (WORLD_SIZE, RANK, ...), or a
    :class:`DistributedError` naming the variable when it is not one."""
    import os

    text = os.environ.get(name)
    if text is None or text.strip() == "":
        return default
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise DistributedError(
            f"environment variable {name}={text!r} is not an integer >= {minimum}: launch with "
            "torchrun or `varuna-fx run`, or set it to a number (or unset it for one process)"
        )
    return value
