"""The replica-sync hooks run one bucket after another, in the order the step submitted them
(runtime/replica_sync.HookReduce): torch's PowerSGD hook issues collectives from its futures'
callbacks, so buckets in flight together would issue them in a different order on each
replica. Here the hooks' futures complete on other threads, later buckets sooner."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from varuna_fx.errors import PeerTimeoutError
from varuna_fx.runtime.sync.replica_sync import HookBucket, HookReduce, Piece


def bucket(i: int, last: bool) -> HookBucket:
    return HookBucket(torch.full((4,), float(i)), [Piece("w", 0, (4,))], i, last)


def test_buckets_run_one_after_another_in_submitted_order() -> None:
    events: list[tuple[str, int]] = []

    def hook(b: HookBucket) -> torch.futures.Future:
        events.append(("start", b.index()))
        future: torch.futures.Future = torch.futures.Future()

        def complete() -> None:  # bucket 0 the slowest: concurrent hooks would finish 2, 1, 0
            time.sleep(0.02 * (3 - b.index()))
            events.append(("end", b.index()))
            future.set_result(b.buffer() * 2)

        threading.Thread(target=complete).start()
        return future

    reduce = HookReduce("rank 0", "a test reduction", timeout=5.0)
    results: dict[int, torch.Tensor] = {}
    for i in range(3):
        reduce.launch(hook, bucket(i, i == 2), lambda r, i=i: results.__setitem__(i, r))
    reduce.start(lambda: events.append(("first", -1)))
    reduce.finish()
    assert events == [("first", -1), ("start", 0), ("end", 0), ("start", 1), ("end", 1),
                      ("start", 2), ("end", 2)]
    torch.testing.assert_close(results[2], torch.full((4,), 4.0))


def test_a_hook_that_never_completes_is_a_peer_timeout() -> None:
    stuck: torch.futures.Future = torch.futures.Future()
    reduce = HookReduce("rank 1", "the data-parallel PowerSGD reduction", timeout=0.05)
    reduce.launch(lambda b: stuck, bucket(0, True), lambda r: None)
    reduce.start()
    try:
        with pytest.raises(PeerTimeoutError, match="PowerSGD reduction"):
            reduce.finish()
    finally:
        stuck.set_result(torch.zeros(4))  # free the worker for whatever runs next


def test_a_hook_error_names_the_reduction() -> None:
    def broken(b: HookBucket) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_exception(RuntimeError("Connection reset by peer"))
        return future

    reduce = HookReduce("rank 1", "the data-parallel bf16 reduction", timeout=1.0)
    reduce.launch(broken, bucket(0, True), lambda r: None)
    reduce.start()
    with pytest.raises(PeerTimeoutError, match="lost the connection.*bf16 reduction"):
        reduce.finish()
