"""``varuna-fx run --elastic --in-place``: machines leave and join while the others keep running.

One launcher per machine starts ``--nproc`` workers running the script and hands each the
membership store's address (``world/membership.py``); it does not restart survivors on a
membership change, as torchrun's agent does (the restart path, ``launch/elastic.py``), because
the workers morph in place (``morph/controller.py``). What the launcher does:

* The launcher whose ``--local-addr`` is the ``--rdzv-endpoint``'s host (or ``--store-host``)
  hosts the store, a c10d ``TCPStore`` in this process. That machine must stay up for the
  job's life, as torchrun's c10d rendezvous host must: give it ``--nproc 0`` and run it on a
  small on-demand machine so that no spot machine is one the job depends on. It exits once its
  own workers are done and no member of the job has beaten its heartbeat for a while.
* A spot notice to the machine (SIGTERM or SIGUSR1 to the launcher) is passed to its workers:
  they hand their state over at the next step boundary and exit 0; the launcher then exits.
* A worker that exits with ``RESTART_EXIT`` (state was lost with its only holders: the job
  resumes from its latest checkpoint) is started again, as is one that failed, up to
  ``--max-restarts``; a new worker joins the running job (or starts it again) as a new member.
  One the running job refused (it runs another model or configuration: ``world/admission.py``)
  is not started again: it would be refused again. The launcher then exits ``REFUSED_EXIT``.

Workers' environment: ``VARUNA_FX_STORE``, ``VARUNA_FX_JOB``, ``VARUNA_FX_MEMBER`` (this
machine's address, the launcher's pid, the local rank and the restart count),
``VARUNA_FX_MIN_WORLD`` / ``VARUNA_FX_MAX_WORLD`` (``--nnodes`` MIN:MAX x ``--nproc``),
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, and ``GLOO_SOCKET_IFNAME`` for the interface holding
``--local-addr`` (as ``elastic.py`` sets it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from types import FrameType
from typing import Any

import torch.distributed as dist

from ..errors import VarunaFxError
from ..morph.controller import RESTART_EXIT
from ..world import membership as ms
from ..world.admission import REFUSED_KEY
from ..world.switches import WorkerEnv, read
from .elastic import DEFAULT_PORT, _same_address, _split_endpoint, interface_of, parse_nnodes

POLL = 0.1
REFUSED_EXIT = 78  # a worker the running job refused (EX_CONFIG): its error says why


@dataclass
class Worker:
    local_rank: int
    process: subprocess.Popen
    restarts: int = 0


@dataclass
class InPlaceLaunch:
    """One machine's launcher of an in-place job."""

    nproc: int
    nnodes: str
    rdzv_endpoint: str | None
    rdzv_id: str
    local_addr: str | None
    max_restarts: int
    argv: list[str]  # the script and its arguments
    store_host: bool | None = None  # None: this machine hosts if --local-addr is the endpoint's
    timeout: float = 300.0
    workers: list[Worker] = field(default_factory=list)
    stopping: int | None = None  # the signal passed on to the workers
    _store: Any = None  # a client of the membership store (made when a worker fails)

    def __post_init__(self) -> None:
        lo, hi = parse_nnodes(self.nnodes)
        if self.rdzv_endpoint is None:
            if hi > 1:
                raise VarunaFxError(
                    "--elastic --in-place with more than one machine needs --rdzv-endpoint "
                    "HOST:PORT: the machine that hosts the membership store (it must stay up)")
            self.rdzv_endpoint = f"127.0.0.1:{DEFAULT_PORT}"
        self.host, self.port = _split_endpoint(self.rdzv_endpoint)
        if self.store_host is None:
            self.store_host = self.local_addr is None and hi == 1 or (
                self.local_addr is not None and _same_address(self.host, self.local_addr))
        self.min_world, self.max_world = lo * max(self.nproc, 1), hi * max(self.nproc, 1)
        self.node = self.local_addr or socket.gethostname()

    def member(self, local_rank: int, restarts: int) -> str:
        """The name a worker registers under (a restart is a new member)."""
        return f"{self.node}.{os.getpid()}.{local_rank}.{restarts}"

    def environment(self, local_rank: int, restarts: int) -> dict[str, str]:
        worker = WorkerEnv(store=f"{self.host}:{self.port}", job=self.rdzv_id,
                           member=self.member(local_rank, restarts),
                           min_world=self.min_world, max_world=self.max_world)
        env = {**worker.environ(), "LOCAL_RANK": str(local_rank),
               "LOCAL_WORLD_SIZE": str(self.nproc)}
        iface = interface_of(self.local_addr) if self.local_addr else None
        if iface is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
            env["GLOO_SOCKET_IFNAME"] = iface
        return env

    def start(self, local_rank: int, restarts: int = 0) -> Worker:
        env = {**os.environ, **self.environment(local_rank, restarts)}
        process = subprocess.Popen([sys.executable, *self.argv], env=env)
        return Worker(local_rank, process, restarts)

    def run(self) -> int:
        """Host the store (if this machine does), start the workers, watch them; the exit
        status of the launcher."""
        store = None
        if self.store_host:
            store = dist.TCPStore(self.host if self.local_addr else "0.0.0.0", self.port, None,
                                  True, timedelta(seconds=self.timeout),
                                  wait_for_workers=False)
        previous = {s: signal.signal(s, self._notice) for s in (signal.SIGTERM, signal.SIGUSR1,
                                                               signal.SIGINT)}
        try:
            self.workers = [self.start(i) for i in range(self.nproc)]
            status = self._watch()
            if store is not None:
                self._serve_until_idle(store)
            return status
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _notice(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = signum
        for w in self.workers:
            if w.process.poll() is None:
                w.process.send_signal(signum)

    def _watch(self) -> int:
        status = 0
        while True:
            running = False
            for k, w in enumerate(self.workers):
                code = w.process.poll()
                if code is None:
                    running = True
                    continue
                refused = code not in (0, RESTART_EXIT) and self._refused(w)
                again = self.stopping is None and not refused and (
                    code == RESTART_EXIT or (code != 0 and w.restarts < self.max_restarts))
                if refused and status == 0:
                    print(f"varuna-fx run --in-place: worker {w.local_rank} was refused by the "
                          "running job (another model or configuration: its error is above); "
                          "not starting it again", file=sys.stderr)
                    status = REFUSED_EXIT
                elif again:
                    print(f"varuna-fx run --in-place: worker {w.local_rank} exited {code}; "
                          "starting it again (it joins as a new member)", file=sys.stderr)
                    self.workers[k] = self.start(w.local_rank, w.restarts + 1)
                    running = True
                elif code != 0 and status == 0 and code != -signal.SIGTERM:
                    status = code if code > 0 else 128 - code
            if not running:
                return status if self.stopping is None else 128 + self.stopping
            time.sleep(POLL)

    def _refused(self, worker: Worker) -> bool:
        """Whether the running job refused ``worker`` (the store says so under its name)."""
        member = self.member(worker.local_rank, worker.restarts)
        if self._store is False:  # the store did not answer before: restart as before
            return False
        try:
            if self._store is None:
                self._store = dist.PrefixStore(f"varuna_fx/{self.rdzv_id}/", dist.TCPStore(
                    self.host, self.port, None, False, timedelta(seconds=10)))
            return bool(self._store.check([REFUSED_KEY.format(member=member)]))
        except (RuntimeError, dist.DistError):
            self._store = False
            return False

    def _serve_until_idle(self, store: object) -> None:
        """Keep the store up while the job may go on: until a member closed its pipeline (the
        job finished) and every member is quiet, or nothing has moved for twice the timeout.
        Other machines' workers may run on after this machine's are done, or start later; and
        when every member vanished at once (a crash during a checkpoint's collective, say),
        their launchers start them again and they need the store to resume the job."""
        job = dist.PrefixStore(f"varuna_fx/{self.rdzv_id}/", store)  # type: ignore[arg-type]
        window = read(ms.WINDOW_ENV)
        last: tuple[int, dict[str, int]] | None = None
        started, quiet = time.monotonic(), time.monotonic()
        while True:
            if not job.check(["gen"]):  # the job has not started
                if time.monotonic() - started > self.timeout:
                    return
                time.sleep(0.25)
                quiet = time.monotonic()
                continue
            gen = ms.Generation.from_json(job.get(f"gen/{int(job.get('gen'))}"))
            joins = int(job.add("joins", 0))
            names = [*gen.members, *(job.get(f"join/{n}").decode()
                                     for n in range(gen.admitted + 1, joins + 1)
                                     if job.check([f"join/{n}"]))]
            keys = [f"beat/{m}" for m in names if job.check([f"beat/{m}"])]
            beats = dict(zip(keys, (int(v) for v in job.multi_get(keys)))) if keys else {}
            if (joins, beats) != last:
                last, quiet = (joins, beats), time.monotonic()
            elif time.monotonic() - quiet > (window if job.check(["finished"])
                                             else max(window, 2 * self.timeout)):
                return
            time.sleep(0.25)
