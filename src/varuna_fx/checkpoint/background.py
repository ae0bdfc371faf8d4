"""Asynchronous saves: the handle a caller waits on and the thread that writes.

``pipe.save_checkpoint(..., async_save=True)`` returns a :class:`SaveHandle` once the state is
copied to host memory; the write (and the rename into place) finishes on a thread, and the
handle's ``result()`` reports it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class SaveHandle:
    """An asynchronous save in flight: ``result()`` waits until the checkpoint is complete
    (renamed into place on every rank) and returns its path, or raises what went wrong."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._future: Future[str] = Future()
        self.reported = False  # its failure reached a caller (the next save need not repeat it)

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> str:
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise
        except BaseException:
            self.reported = True
            raise


def in_thread(fn: Callable[[], Any]) -> Future:
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
