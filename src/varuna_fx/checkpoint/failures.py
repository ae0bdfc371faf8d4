"""What a failed save or load tells the user, and what it leaves behind.

* Storage errors (a full disk, a read-only filesystem, a missing permission) become a
  :class:`CheckpointError` saying what failed, where, and what to do; the raw ``OSError`` (or
  DCP's ``CheckpointException`` carrying one from another rank) is chained.
* A load that fails after its first byte reached the model (a truncated or damaged shard, a
  tampered entry, an optimizer that does not fit) leaves some tensors overwritten. They are
  marked with ``vf.skip_init``'s machinery (``init/skip.py``), and the load returns a
  :class:`FailedLoad` that the pipeline keeps (``Pipeline._failed_load``), so it refuses to step
  or evaluate -- on every rank that failed -- until a load succeeds; the refusal names the
  checkpoint and the error.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable

import torch
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import CheckpointError
from ..init.skip import mark

_ADVICE = {
    errno.ENOSPC: "the disk is full: free space or save elsewhere",
    errno.EDQUOT: "the disk quota is exhausted: free space or save elsewhere",
    errno.EROFS: "the filesystem is read-only: save to a writable directory",
    errno.EACCES: "permission denied: save to a directory this user may write",
    errno.EPERM: "permission denied: save to a directory this user may write",
}


def underlying(exc: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's ``CheckpointException``."""
    if isinstance(exc, CheckpointException):
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                return inner
    return exc


def storage_error(exc: BaseException, path: str, doing: str) -> CheckpointError:
    """``exc`` (raised ``doing`` something to ``path``) as the error a user reads."""
    inner = underlying(exc)
    if isinstance(inner, CheckpointError):
        return inner
    if isinstance(inner, OSError):
        where = f" ({inner.filename})" if inner.filename else ""
        advice = _ADVICE.get(inner.errno or 0, "check the filesystem")
        return CheckpointError(f"{doing} {path} failed: {inner.strerror or inner}{where}; "
                               f"{advice}")
    return CheckpointError(f"{doing} {path} failed: {type(inner).__name__}: {inner}")


def load_error(exc: BaseException, path: str) -> CheckpointError:
    """What a load that failed while reading or applying the checkpoint raises."""
    inner = underlying(exc)
    if isinstance(inner, CheckpointError):
        return inner
    if isinstance(inner, OSError):
        return CheckpointError(
            f"{path}: reading its tensors failed ({inner}); the checkpoint's files are "
            "damaged or incomplete: load an earlier checkpoint, or copy this one again")
    return CheckpointError(
        f"{path} holds something varuna_fx did not write ({type(inner).__name__}: {inner}): "
        "it was tampered with or comes from another program; load a checkpoint "
        "pipe.save_checkpoint wrote")


class FailedLoad:
    """The refusal a pipeline raises while a failed load's partial overwrite stands;
    ``error``: what the failed load itself raises."""

    def __init__(self, path: str, error: BaseException, call: str = "load_checkpoint") -> None:
        self.error = error
        said = str(error).splitlines()[0] if str(error) else type(error).__name__
        self.message = f"the last pipe.{call}({path!r}) failed partway ({said})"

    def refuse(self, names: list[str], where: str) -> None:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise CheckpointError(
            f"{self.message}, so {len(names)} parameter(s)/buffer(s){where} may hold a mix of "
            f"the checkpoint's values and earlier ones ({shown}): load a checkpoint "
            "successfully before stepping")


def mark_failed(tensors: Iterable[torch.Tensor], path: str, error: BaseException,
                call: str = "load_checkpoint") -> FailedLoad:
    """Mark ``tensors`` as not loaded; the refusal to keep until a load by ``call`` succeeds
    (``Pipeline._check_loaded`` raises it)."""
    for t in tensors:
        mark(t)
    return FailedLoad(path, error, call)
