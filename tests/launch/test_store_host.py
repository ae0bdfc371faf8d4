"""The store host of an in-place job (``--nproc 0``) stays up while the job may go on: every
member vanishing at once is not the end (their launchers start them again and they register
anew), a member closing its pipeline is; and the checkpoint's agreement reports a lost peer as
an error the in-place job recovers from."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from varuna_fx.checkpoint.agreement import Agreement
from varuna_fx.errors import PeerTimeoutError
from varuna_fx.launch.in_place import InPlaceLaunch
from varuna_fx.world import membership as ms


def _served(monkeypatch: pytest.MonkeyPatch, act) -> float:
    """Seconds ``_serve_until_idle`` served a one-member job while ``act(job)`` ran."""
    monkeypatch.setenv(ms.WINDOW_ENV, "0.2")
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10),
                          wait_for_workers=False)
    job = dist.PrefixStore("varuna_fx/t/", store)
    job.set("gen/0", ms.Generation(0, ("a",), ("a",), admitted=1).to_json())
    job.set("gen", "0")
    job.add("joins", 1)
    job.set("join/1", "a")
    job.add("beat/a", 1)
    launch = InPlaceLaunch(nproc=0, nnodes="1:1", rdzv_endpoint="127.0.0.1:1", rdzv_id="t",
                           local_addr=None, max_restarts=0, argv=[], timeout=0.75)
    start = time.monotonic()
    server = threading.Thread(target=launch._serve_until_idle, args=(store,), daemon=True)
    server.start()
    act(job)
    server.join(timeout=20)
    assert not server.is_alive()
    return time.monotonic() - start


def test_every_member_gone_waits_for_their_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    def restart(job: object) -> None:  # "a" died; its relaunch registers 1 s later and beats
        time.sleep(1.0)
        job.add("joins", 1)  # type: ignore[attr-defined]
        job.set("join/2", "a2")  # type: ignore[attr-defined]
        for _ in range(5):
            job.add("beat/a2", 1)  # type: ignore[attr-defined]
            time.sleep(0.1)

    # quiet for 2 x 0.75 s only after the relaunch's last beat (~1.5 s in)
    assert _served(monkeypatch, restart) > 2.8


def test_a_finished_job_stops_serving_once_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _served(monkeypatch, lambda job: job.set("finished", "a")) < 1.2


def test_the_checkpoint_agreement_names_a_lost_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("[pair.cc:553] Connection closed by peer [10.0.0.3]:4242")

    monkeypatch.setattr(dist, "all_gather_object", broken)
    with pytest.raises(PeerTimeoutError, match="lost a peer while the ranks agreed on saving"
                                               ".*Connection closed by peer"):
        Agreement(object(), 1, 2).agree(None, "saving x")
