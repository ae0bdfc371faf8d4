"""Running an in-place job's workers from a test: the test hosts the membership store (as the
launcher of the rendezvous machine does, ``varuna_fx.launch.in_place``) and starts each worker
process with the environment that launcher gives it (:class:`InPlaceJob`); or the test runs the
launcher itself (``varuna-fx run/train --elastic --in-place``: :func:`launcher_env`), reads its
output as it comes (:class:`Lines`) and signals one of its workers (:func:`worker_pid`)."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from support.ranks import free_port

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
                   VARUNA_FX_MAX_WORLD=str(self.max_world), VARUNA_FX_HEARTBEAT_WINDOW="2",
                   VARUNA_FX_PREPLAN="1")  # (as launcher_env: its child beside every morph)
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


def launcher_env() -> dict[str, str]:
    """The environment to run ``varuna-fx ... --elastic --in-place`` with: this checkout, one
    thread, no GPU, short waits and heartbeat window (a lost process is found in ~2 s), and
    pre-planning on (off by default on CPU: ``morph/preplan.py``), so that its forked child
    runs beside every morph, notice, kill and join these tests make."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"),
               CUDA_VISIBLE_DEVICES="", VARUNA_FX_TIMEOUT="60", VARUNA_FX_HEARTBEAT_WINDOW="2",
               VARUNA_FX_PREPLAN="1")
    for key in ("VARUNA_FX_STORE", "LOCAL_RANK", "WORLD_SIZE", "RANK"):
        env.pop(key, None)
    return env


def worker_pid(launcher: subprocess.Popen[Any], local_rank: int, restarts: int = 0) -> int:
    """The pid of the in-place launcher's worker of ``local_rank`` (its ``restarts``-th start:
    member names end in ``.<local_rank>.<restarts>``)."""
    tail = f".{local_rank}.{restarts}".encode()
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    for pid in children:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # (exited meanwhile)
            continue
        if any(e.startswith(b"VARUNA_FX_MEMBER=") and e.endswith(tail) for e in env):
            return int(pid)
    raise AssertionError(f"no worker {tail.decode()} among the launcher's children {children}")


class Lines:
    """A process's merged output, read by a thread as it comes: ``wait_for`` a line matching a
    pattern (with a deadline: the process may hang or die), ``text`` for an assertion's
    message."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc, self.seen, self._new = proc, [], queue.Queue()  # type: ignore[var-annotated]
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._new.put(line)
        self._new.put(None)

    def wait_for(self, pattern: str, timeout: float = 180.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._new.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} within {timeout:.0f} s"
                                     f"\n{self.text()}") from None
            if line is None:
                self._new.put(None)
                raise AssertionError(f"the process ended before a line matching {pattern!r}"
                                     f"\n{self.text()}")
            self.seen.append(line)
            if re.search(pattern, line):
                return line

    def finish(self, timeout: float = 240.0) -> int:
        """Wait for the process; its exit status (the rest of its output is read)."""
        code = self.proc.wait(timeout=timeout)
        while (line := self._new.get(timeout=30)) is not None:
            self.seen.append(line)
        self._new.put(None)
        return code

    def text(self) -> str:
        return "".join(self.seen)[-6000:]
