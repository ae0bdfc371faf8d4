"""Running an in-place job's workers from a test: the test hosts the membership store (as the
launcher of the rendezvous machine does, ``varuna_fx.launch.in_place``) and starts each worker
process with the environment that launcher gives it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from support.dist import free_port

ROOT = Path(__file__).resolve().parents[2]


class InPlaceJob:
    """``with InPlaceJob(out) as job: job.start("m0", [...]); ...``: workers of one job."""

    def __init__(self, out: Path, *, min_world: int = 1, max_world: int = 4,
                 timeout: float = 60.0) -> None:
        self.out, self.min_world, self.max_world, self.timeout = out, min_world, max_world, timeout
        self.port = free_port()
        self.procs: dict[str, subprocess.Popen[Any]] = {}

    def __enter__(self) -> InPlaceJob:
        self.server = dist.TCPStore("127.0.0.1", self.port, None, True,
                                    timedelta(seconds=self.timeout), wait_for_workers=False)
        self.store = dist.PrefixStore("varuna_fx/test/", self.server)
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)

    def start(self, member: str, argv: list[str]) -> subprocess.Popen[Any]:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"),
                   VARUNA_FX_TIMEOUT=str(int(self.timeout)), CUDA_VISIBLE_DEVICES="",
                   VARUNA_FX_STORE=f"127.0.0.1:{self.port}", VARUNA_FX_JOB="test",
                   VARUNA_FX_MEMBER=member, VARUNA_FX_MIN_WORLD=str(self.min_world),
                   VARUNA_FX_MAX_WORLD=str(self.max_world), VARUNA_FX_HEARTBEAT_WINDOW="2")
        with (self.out / f"{member}.out").open("w") as log:
            p = subprocess.Popen([sys.executable, *argv], env=env, stdout=log,
                                 stderr=subprocess.STDOUT)
        self.procs[member] = p
        return p

    def registered(self) -> int:
        """How many processes have asked to take part so far."""
        return int(self.store.add("joins", 0))

    def wait_until(self, what: str, pred: Any, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.tails()}")
            for name, p in self.procs.items():
                if p.poll() not in (None, 0):
                    raise AssertionError(f"{name} exited {p.returncode} while waiting for "
                                         f"{what}\n{self.tails()}")
            time.sleep(0.1)

    def finish(self, timeout: float = 240.0) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        return {name: p.returncode for name, p in self.procs.items()}

    def tails(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}"
                         for f in sorted(self.out.glob("*.out")))
