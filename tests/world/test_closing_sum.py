"""A step of an in-place job closes through the membership store (``world/closing.py``):
every rank gets the same sums once every rank wrote; a rank that failed, or a writer that
stopped beating, makes every waiting rank fail instead, so no survivor finishes a step that
another runs again."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from varuna_fx.errors import PeerTimeoutError
from varuna_fx.world.closing import closing_sum
from varuna_fx.world.membership import Generation, Membership

MEMBERS = ("m0", "m1", "m2")


@pytest.fixture
def members() -> Any:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10),
                           wait_for_workers=False)
    made = []
    for name in MEMBERS:
        m = Membership(address=f"127.0.0.1:{server.port}", job="t", member=name, timeout=10.0,
                       window=0.1)
        m.connect()
        m.generation = Generation(3, MEMBERS, MEMBERS, admitted=3)
        made.append(m)
    yield made
    for m in made:
        m.stop()
    del server


def _each(members: list[Membership], work: dict[int, Any]) -> dict[int, Any]:
    out: dict[int, Any] = {}

    def run(rank: int) -> None:
        try:
            out[rank] = work[rank](members[rank])
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    return out


def test_every_rank_gets_the_same_sums_and_old_values_go(members: list[Membership]) -> None:
    for index in range(3):
        got = _each(members, {r: (lambda m, r=r, i=index: closing_sum(m, i, r, [r, 1.0, i]))
                              for r in range(3)})
        assert all(got[r] == [3.0, 3.0, 3.0 * index] for r in range(3)), got
    store = members[0].store
    assert not store.check(["gen/3/sum/0/0"]) and store.check(["gen/3/sum/1/0"])


def test_a_rank_that_failed_stops_the_others(members: list[Membership]) -> None:
    def failing(m: Membership) -> None:  # its reductions failed: it recovers, never writes
        time.sleep(0.3)
        m.store.compare_set("gen/3/failed", "", m.member)

    start = time.monotonic()
    got = _each(members, {0: lambda m: closing_sum(m, 0, 0, [1.0]),
                          1: lambda m: closing_sum(m, 0, 1, [1.0]), 2: failing})
    assert time.monotonic() - start < 3.0
    for r in (0, 1):
        assert isinstance(got[r], PeerTimeoutError) and "m2 lost a peer" in str(got[r])


def test_a_writer_that_died_stops_the_others(members: list[Membership]) -> None:
    for m in members[:2]:
        m._start_beating()  # m2 never beats: it died before writing
    got = _each(members, {0: lambda m: closing_sum(m, 0, 0, [1.0]),
                          1: lambda m: closing_sum(m, 0, 1, [1.0])})
    for r in (0, 1):
        assert isinstance(got[r], PeerTimeoutError), got[r]
        assert "m2 stopped beating" in str(got[r])


def test_a_rank_that_never_writes_times_out(members: list[Membership]) -> None:
    for m in members:  # a window longer than the wait: only the timeout can end it
        m.timeout, m.window = 0.5, 30.0
    with pytest.raises(PeerTimeoutError, match="waited 0 s for every rank to close step 0"):
        closing_sum(members[0], 0, 0, [1.0])
