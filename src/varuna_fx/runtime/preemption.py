"""Preemption signals: SIGTERM (what torchrun and cloud schedulers send) and SIGUSR1 (Varuna's).

The handler only records that a signal came; the process keeps running. Every step then
carries this rank's flag on the world all-reduce that already carries the loss, so every rank
sets ``pipe.preempted`` after the same step and the preemption-safe training loop (README, docs/checkpoints.md) saves a
checkpoint and exits together -- well within torchrun's 30 s grace before SIGKILL.

Handlers are installed by the distributed runtime (under torchrun) and, in one process, by
``pipe.install_preemption_handlers()``. A Python handler installed before ours still runs
(after ours); the default action (terminate) does not, since stopping at a step boundary is the
point.
"""

from __future__ import annotations

import signal
import threading
import time
import warnings
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_received: list[int] = []  # signal numbers received by this process
_received_at: list[float] = []  # time.time() of each
_installed: dict[int, Any] = {}  # signal -> the handler ours replaced


def requested() -> bool:
    """Whether this process received a preemption signal."""
    return bool(_received)


def received_at() -> float | None:
    """When (``time.time()``) the first preemption signal came, if one did."""
    return _received_at[0] if _received_at else None


def clear() -> None:
    """Forget received signals (a new job in the same process, tests)."""
    _received.clear()
    _received_at.clear()


def _handler(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)
    _received_at.append(time.time())
    previous = _installed.get(signum)
    if callable(previous):
        previous(signum, frame)


def install_handlers() -> bool:
    """Catch SIGTERM and SIGUSR1 (once per process; chained to earlier Python handlers).
    Returns False, with a warning, when called off the main thread (Python allows signal
    handlers only there)."""
    if threading.current_thread() is not threading.main_thread():
        warnings.warn("varuna_fx: preemption handlers can only be installed from the main "
                      "thread; SIGTERM/SIGUSR1 will not set pipe.preempted", stacklevel=3)
        return False
    for sig in SIGNALS:
        current = signal.getsignal(sig)
        if current is _handler:
            continue
        _installed[sig] = current
        signal.signal(sig, _handler)
    return True
