"""What the train command's in-process tests share."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from varuna_fx.runtime import preemption
from varuna_fx.train import worker as train_worker


@pytest.fixture
def handlers() -> Iterator[None]:
    """Run.train installs the preemption and Ctrl-C handlers: put this process's back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    preemption.clear()
    train_worker._INTERRUPTED.clear()
