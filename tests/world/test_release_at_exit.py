"""A process group varuna_fx formed is released at exit, while the interpreter is whole: left
to finalisation, gloo could abort a rank whose work was done ("terminate called without an
active exception", SIGABRT), and torchrun then failed the job. Seen once in CI, in
tests/planner/test_profile_on_two_ranks.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch.distributed as dist

from support.ranks import free_port
from varuna_fx.world import where

CHILD = textwrap.dedent("""
    import atexit, sys
    import torch.distributed as dist
    from varuna_fx.world.where import init_process_group
    # registered first, so it runs last: after varuna_fx's own exit handler
    atexit.register(lambda: print("at exit, initialized:", dist.is_initialized(), flush=True))
    if sys.argv[1] == "user":
        dist.init_process_group("gloo")  # the user's group: theirs to release
    init_process_group(30.0)
    dist.all_reduce(__import__("torch").ones(3))
""")


@pytest.mark.slow
@pytest.mark.parametrize("who, left", [("varuna_fx", "False"), ("user", "True")])
def test_the_group_varuna_fx_formed_is_released_at_exit_and_the_users_is_not(
        who: str, left: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    done = subprocess.run([sys.executable, "-c", CHILD, who], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"at exit, initialized: {left}" in done.stdout


def test_releasing_gives_up_on_a_destroy_that_hangs(monkeypatch: pytest.MonkeyPatch) -> None:
    stuck = threading.Event()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: stuck.wait(60))
    monkeypatch.setattr(where, "RELEASE_SECONDS", 0.2)
    start = time.monotonic()
    where.release_process_group()  # a peer died mid-collective: exit must not wait on it
    assert time.monotonic() - start < 5
    stuck.set()


def test_releasing_without_a_group_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: pytest.fail("nothing to destroy"))
    where.release_process_group()
