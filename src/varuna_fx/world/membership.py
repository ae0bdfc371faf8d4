"""Membership for in-place morphing: which processes form the job, generation after generation,
kept in a c10d ``TCPStore`` that outlives them.

Why not torchrun's agent: its rendezvous stops and restarts every worker whenever a machine
leaves or joins (the restart path, ``launch/elastic.py``). Here the workers hold membership
themselves, so survivors keep running. ``varuna-fx run --elastic --in-place`` hosts the store in
the launcher of the rendezvous machine (``launch/in_place.py``) and hands every worker its
address; a worker joins in ``world.where.init_process_group`` (``vf.compile`` calls it).

A *generation* is one membership of the job: the processes in rank order, and one gloo (NCCL)
process group made on a ``PrefixStore`` of its own (``gen/<g>/pg/``). Gloo groups cannot
shrink, so a morph destroys the old group and every member of the next generation forms a new
one on the store, which does not depend on any worker. Keys, under ``varuna_fx/<job>/``:

  ``joins``               how many processes ever asked to take part (``store.add``)
  ``join/<n>``            the n-th one's member name
  ``beat/<member>``       its heartbeat: a counter a thread adds to every ``BEAT`` seconds, on a
                          connection of its own; a member whose counter stops is gone
  ``gen``, ``gen/<g>``    the current generation's number; generation g's record (JSON)
  ``gen/<g>/alive/<m>``   survivors of a failure in generation g, while they agree on the next
  ``gen/<g>/blob/<k>``    what a morph exchanges besides tensors (descriptors, a joiner's recipe)

How generations change:

* **start**: the first process to register waits for ``min_world`` (the launcher's MIN nodes x
  processes per node), then ``LAST_CALL`` seconds or ``max_world``, and writes generation 0.
* **at a step boundary** (a spot notice rode on the step's all-reduce, or rank 0 saw a process
  waiting to join): the old group still works; its rank 0 writes the next record from what every
  rank said (``after_boundary``). Members that leave take part in moving state over a *transfer
  group* (members + leavers, ``gen/<g>/xfer/``), then exit.
* **after a failure** (a process vanished: a receive or collective failed): every survivor
  registers ``alive``; a member counts as lost once its heartbeat has not moved for
  ``window`` seconds; the first survivor to decide writes the record (``compare_set``: one
  writer), the others adopt it (``recover``).

Joiners wait for a generation that names them; rank 0 admits, at each step boundary, those whose
heartbeat has been seen to move (one that registered and died is never admitted) and whose
fingerprint (``print/<member>``: the model and configuration, ``admission.py``) is its own; one
that differs is refused (``refused/<member>``), raises, and the job runs on.

The machine whose launcher hosts the store must stay up, as torchrun's c10d rendezvous host
must: it can be a small on-demand machine running no workers (``--nproc 0``). Base layer:
imports only torch.distributed, ``errors``, ``sockets`` and ``heartbeats``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DistributedError, PeerTimeoutError
from . import safe_json, sockets
from .admission import PRINT_KEY, REFUSED_KEY, registrant_refusal
from .heartbeats import Stopped
from .switches import SWITCHES, WorkerEnv, read

# the launcher's record of a worker (host:port of the store, the job, this member's name, the
# world's bounds): ``switches.WorkerEnv``
STORE_ENV = "VARUNA_FX_STORE"
WINDOW_ENV = "VARUNA_FX_HEARTBEAT_WINDOW"  # seconds without a heartbeat before a member is lost
BEAT = 0.25  # seconds between heartbeats
# default: a loaded machine may not schedule a thread for a second or two
WINDOW = float(SWITCHES[WINDOW_ENV].default)
LAST_CALL = 1.0  # seconds generation 0 waits for more processes once min_world are there
POLL = 0.02


def in_place() -> bool:
    """This process is a worker of an in-place job (``varuna-fx run --elastic --in-place``)."""
    return read(STORE_ENV) is not None


@dataclass(frozen=True)
class Generation:
    """One membership of the job, as its record in the store says."""

    number: int
    members: tuple[str, ...]  # rank order of this generation's process group
    # who moves state into this generation: the members, then those leaving (a transfer group
    # of its own when there are any; else the members' group)
    transfer: tuple[str, ...]
    admitted: int  # how many registrations (``joins``) have been consumed
    reason: str = "start"  # "start" | "notice" | "join" | "lost"
    joined: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()
    # the planning cluster of the new world (plain data: planner/cluster.py reads it), so that
    # survivors and joiners plan alike without measuring the network again
    cluster: dict[str, Any] | None = None
    global_batch_size: int | None = None  # the running job's, which every layout keeps
    running: bool = False  # state lives in the members: a joiner takes it from them

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: bytes | str) -> Generation:
        data = safe_json.loads(text)
        for key in ("members", "transfer", "joined", "left", "lost"):
            data[key] = tuple(data[key])
        return cls(**data)

    def rank_of(self, member: str) -> int:
        return self.members.index(member)

    @property
    def restarted(self) -> bool:
        """This generation starts the job again (:meth:`Membership.mark_restart`: state was
        lost with its only holders): a "start" that is not the first generation."""
        return self.reason == "start" and self.number > 0


@dataclass
class Membership:
    """This process's view of the job's membership (one per process: :func:`membership`)."""

    address: str  # host:port of the store
    job: str
    member: str
    timeout: float = 300.0
    min_world: int = 1
    max_world: int = 1 << 30
    window: float = WINDOW
    generation: Generation | None = None
    store: Any = None
    _beats: Any = None
    _seen: dict[str, tuple[int, float]] = field(default_factory=dict)  # pending joiner beats
    _stop: threading.Event = field(default_factory=threading.Event)
    _before: frozenset[str] = frozenset()  # sockets open before this generation formed
    # what this process runs (admission.py), offered before it registers; {}: none offered
    fingerprint: dict[str, str] = field(default_factory=dict)
    _refused: set[str] = field(default_factory=set)  # registrants this process refused

    @classmethod
    def from_env(cls, timeout: float) -> Membership:
        worker = WorkerEnv.read()
        assert worker is not None, "in_place(): the launcher's record is in the environment"
        return cls(address=worker.store, job=worker.job,
                   member=worker.member or f"pid{os.getpid()}", timeout=timeout,
                   min_world=worker.min_world, max_world=worker.max_world,
                   window=read(WINDOW_ENV))

    # -- the store ---------------------------------------------------------------------------

    def _client(self) -> Any:
        host, _, port = self.address.rpartition(":")
        try:
            client = dist.TCPStore(host, int(port), None, False, timedelta(seconds=self.timeout))
        except (RuntimeError, dist.DistError) as exc:
            raise PeerTimeoutError(
                f"{self.member} could not reach the membership store at {self.address} within "
                f"{self.timeout:.0f} s: is the launcher that hosts it (varuna-fx run --elastic "
                f"--in-place on the rendezvous machine) running? ({str(exc).splitlines()[0]})"
            ) from exc
        return dist.PrefixStore(f"varuna_fx/{self.job}/", client)

    def connect(self) -> None:
        if self.store is None:
            self.store = self._client()

    def _wait_key(self, key: str, what: str, deadline: float | None = None) -> bytes:
        deadline = deadline or time.monotonic() + self.timeout
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise PeerTimeoutError(f"{self.member} waited {self.timeout:.0f} s for {what} "
                                       f"(store key {key!r}) and gave up")
            time.sleep(POLL)
        return self.store.get(key)

    def put(self, generation: int, name: str, value: bytes) -> None:
        self.store.set(f"gen/{generation}/blob/{name}", value)

    def get(self, generation: int, name: str, what: str) -> bytes:
        return self._wait_key(f"gen/{generation}/blob/{name}", what)

    # -- heartbeats --------------------------------------------------------------------------

    def _start_beating(self) -> None:
        if self._beats is not None:
            return
        # a connection of its own: the main thread may block on its client (a group forming)
        client = self._client()
        key = f"beat/{self.member}"
        client.add(key, 1)

        def beat() -> None:
            while not self._stop.wait(BEAT):
                try:
                    client.add(key, 1)
                except Exception:  # noqa: BLE001 - the store is gone: the job is over
                    return

        self._beats = threading.Thread(target=beat, name="varuna_fx-heartbeat", daemon=True)
        self._beats.start()

    def stop(self) -> None:
        self._stop.set()

    def beats(self, members: list[str]) -> dict[str, int]:
        keys = [f"beat/{m}" for m in members]
        present = [k for k in keys if self.store.check([k])]
        values = dict(zip(present, self.store.multi_get(present))) if present else {}
        return {m: int(values.get(f"beat/{m}", b"0")) for m in members}

    # -- joining -----------------------------------------------------------------------------

    def offer(self, parts: dict[str, str]) -> None:
        """Add ``parts`` to the fingerprint this process registers with (before it joins; a
        later compile in a process that joined changes nothing)."""
        if self.generation is None:
            self.fingerprint.update(parts)

    def join(self) -> Generation:
        """Register and wait until a generation names this process; returns it (the process
        group is not formed yet: :meth:`form`). Raises :class:`DistributedError` when the
        running job refuses it (another model or configuration: ``admission.py``)."""
        self.connect()
        self._start_beating()
        self.store.set(PRINT_KEY.format(member=self.member), json.dumps(self.fingerprint))
        number = self.store.add("joins", 1)
        self.store.set(f"join/{number}", self.member)
        deadline = time.monotonic() + self.timeout
        if number == 1 and not self.store.check(["gen"]):
            self._start_job(0, 0, self.min_world, deadline)
        if not self.store.check(["gen"]):
            self._wait_key("gen", "the job's first generation", deadline)
        gen = self._record(int(self.store.get("gen")))
        watch = _Silence(self, gen)
        while True:
            if self.member in gen.members:
                self.generation = gen
                return gen
            if self.store.check(["finished"]):
                raise DistributedError(
                    f"{self.member} was to join job {self.job!r}, which has finished (its "
                    f"process {self.store.get('finished').decode()} closed its pipeline)")
            refused = REFUSED_KEY.format(member=self.member)
            if self.store.check([refused]):
                self.stop()  # (its heartbeat ends: the job has settled it as gone)
                raise DistributedError(self.store.get(refused).decode())
            if gen.reason == "restart" and number == gen.admitted + 1:
                # the job restarts (state was lost): the first to register since leads it
                self._start_job(gen.number + 1, gen.admitted, max(1, len(gen.joined)),
                                deadline)
            if time.monotonic() > deadline:
                raise PeerTimeoutError(
                    f"{self.member} waited {self.timeout:.0f} s to be admitted to the "
                    f"running job (generation {gen.number}: {len(gen.members)} members); "
                    "rank 0 admits a process at a step boundary")
            if self.store.check([f"gen/{gen.number + 1}"]):
                gen = self._record(gen.number + 1)
                watch = _Silence(self, gen)
            elif watch.all_gone():  # every member vanished: nobody is left to admit us
                self.mark_restart(gen)
            else:
                time.sleep(POLL)

    def _start_job(self, g: int, after: int, wanted: int, deadline: float) -> None:
        """Generation ``g`` of a job (re)starting from its checkpoint: the processes that
        registered after the first ``after``, once ``wanted`` did (and ``LAST_CALL`` more)."""
        def count() -> int:
            return int(self.store.add("joins", 0)) - after

        while count() < wanted:
            if time.monotonic() > deadline:
                raise PeerTimeoutError(
                    f"only {count()} of the {wanted} processes the job needs to start "
                    f"registered within {self.timeout:.0f} s")
            time.sleep(POLL)
        def names() -> list[str]:
            return [self.store.get(f"join/{k}").decode()
                    for k in range(after + 1, after + count() + 1)]

        before = self.beats(names())
        last = time.monotonic() + LAST_CALL
        while time.monotonic() < last and count() < self.max_world:
            time.sleep(POLL)
        time.sleep(2 * BEAT)  # every live registrant beats meanwhile; a dead one does not
        every = names()
        now = self.beats(every)
        live = tuple(m for m in every if now[m] > before.get(m, 0))[:self.max_world]
        self._publish(Generation(g, live, live, admitted=after + len(every)))

    def mark_restart(self, gen: Generation, back: tuple[str, ...] = ()) -> Generation:
        """The job cannot continue in place (state was lost with its only holders, or every
        member vanished): generation ``gen.number + 1`` names nobody, so every process that
        registers from now on starts the job again (its script resumes from the latest
        checkpoint): those that registered after the generation that failed, the first of them
        leading (:meth:`_start_job`), once as many as ``back`` (the members its launchers will
        start again) did."""
        return self._publish(Generation(
            gen.number + 1, (), (), admitted=gen.admitted, reason="restart", joined=back))

    def finished(self) -> None:
        """This job is over (a member closed its pipeline): processes waiting to join exit.
        (A process that left the job closing its pipeline says nothing.)"""
        gen = self.generation
        if self.store is not None and gen is not None and self.member in gen.members:
            self.store.set("finished", self.member)

    def job_finished(self) -> bool:
        """Whether a member closed its pipeline: the job is over (a process that was to join
        it has nothing to do)."""
        return self.store is not None and bool(self.store.check(["finished"]))

    def _record(self, g: int) -> Generation:
        return Generation.from_json(self._wait_key(f"gen/{g}", f"generation {g}'s record"))

    def _publish(self, gen: Generation) -> Generation:
        """Write ``gen`` unless another process wrote that generation first; the record that
        won, and ``gen`` advanced to it."""
        key = f"gen/{gen.number}"
        won = Generation.from_json(self.store.compare_set(key, "", gen.to_json()))
        # (a record g + 1 is only ever written by a process that read record g, so "gen" only
        # grows however its writers interleave)
        self.store.set("gen", str(won.number))
        return won

    # -- the process group of a generation ---------------------------------------------------

    def form(self, gen: Generation, backend: str) -> None:
        """Destroy the old process group (every group of it) and form ``gen``'s."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self.generation = gen
        if self.member not in gen.members:
            return
        self._before = sockets.opened()
        prefix = dist.PrefixStore(f"gen/{gen.number}/pg/", self.store)
        dist.init_process_group(backend, store=prefix, rank=gen.rank_of(self.member),
                                world_size=len(gen.members),
                                timeout=timedelta(seconds=self.timeout))

    def sever(self) -> int:
        """After a failure: end every connection this process opened since its generation
        formed, except the store's (``world/sockets.py``)."""
        host, _, port = self.address.rpartition(":")
        return sockets.sever(self._before, {(ip, int(port)) for ip in sockets.addresses(host)})

    def transfer_group(self, gen: Generation) -> Any:
        """The group state moves over: None (the members' own group) when nobody leaves, else
        a gloo group of the members and the leavers on the store, outside torch.distributed's
        default group (which the leavers are no longer in)."""
        if gen.transfer == gen.members:
            return None
        prefix = dist.PrefixStore(f"gen/{gen.number}/xfer/", self.store)
        return dist.ProcessGroupGloo(prefix, gen.transfer.index(self.member), len(gen.transfer),
                                     timedelta(seconds=self.timeout))

    # -- morphs ------------------------------------------------------------------------------

    def joins_waiting(self) -> bool:
        """Rank 0, every step: whether a registered process is ready to be admitted (its
        heartbeat moved since it was first seen). One store round trip when nobody waits."""
        gen = self.generation
        assert gen is not None
        count = int(self.store.add("joins", 0))
        if count <= gen.admitted:
            return False
        return bool(self._admit(gen, count, 1)[0])

    def _admit(self, gen: Generation, count: int, room: int) -> tuple[tuple[str, ...], int]:
        """(the processes registered after ``gen.admitted`` that are ready to be admitted, at
        most ``room``; how many registrations are settled). Ready: its heartbeat moved since
        this process first saw it; one silent for twice the heartbeat window is settled as
        gone, so a process that registered and died is never admitted nor waited for."""
        numbers = range(gen.admitted + 1, count + 1)
        names = [self.store.get(f"join/{n}").decode() for n in numbers]
        beats = self.beats(names)
        now = time.monotonic()
        joined: list[str] = []
        settled, blocked = gen.admitted, False
        for n, name in zip(numbers, names):
            first = self._seen.setdefault(name, (beats[name], now))
            ready = beats[name] > first[0]
            refused = ready and self._refuses(name)  # settled: never admitted, not waited for
            if ready and not refused and len(joined) < room:
                joined.append(name)
            gone = refused or (not ready and now - first[1] > 2 * self.window)
            blocked = blocked or not (name in joined or gone)
            if not blocked:
                settled = n
        return tuple(joined), settled

    def _refuses(self, name: str) -> bool:
        """Whether registrant ``name`` runs another model or configuration than this process
        (``admission.py``); the first time, its refusal is written for it to read."""
        if name in self._refused:
            return True
        text = registrant_refusal(self.store, self.job, self.fingerprint, name)
        if text is None:
            return False
        self._refused.add(name)
        self.store.set(REFUSED_KEY.format(member=name), text)
        print(f"varuna_fx: {text}", file=sys.stderr, flush=True)
        return True

    def after_boundary(self, leaving: list[bool], cluster: dict[str, Any] | None,
                       global_batch_size: int | None) -> Generation:
        """Old rank 0, at a step boundary: the next generation (survivors in rank order, then
        the joiners that are ready), written to the store. ``leaving``: per old rank."""
        gen = self.generation
        assert gen is not None
        stay = [m for m, out in zip(gen.members, leaving) if not out]
        gone = tuple(m for m, out in zip(gen.members, leaving) if out)
        joined, admitted = self._admit(gen, int(self.store.add("joins", 0)),
                                       max(0, self.max_world - len(stay)))
        members = (*stay, *joined)
        reason = "notice" if gone else "join"
        return self._publish(Generation(
            gen.number + 1, members, (*members, *gone), admitted=admitted, reason=reason,
            joined=joined, left=gone, cluster=_resized(cluster, len(members)),
            global_batch_size=global_batch_size, running=True))

    def record(self, number: int) -> Generation:
        return self._record(number)

    def recover(self, cluster: dict[str, Any] | None,
                global_batch_size: int | None) -> Generation:
        """After a failure in the current generation: agree with the other survivors on the
        next one (see the module docstring). Raises when this process was counted lost."""
        gen = self.generation
        assert gen is not None
        # (first: a peer waiting to close the step learns that this step failed)
        self.store.compare_set(f"gen/{gen.number}/failed", "", self.member)
        self.store.set(f"gen/{gen.number}/alive/{self.member}", "1")
        key = f"gen/{gen.number + 1}"
        deadline = time.monotonic() + self.timeout
        watch = Stopped(self.beats, list(gen.members), self.window)
        alive: set[str] = set()
        lost: set[str] = set()
        while not self.store.check([key]):
            now, gone = time.monotonic(), watch.gone()  # (a beating one is still in its step)
            for m in gen.members:
                if m in alive or m in lost:
                    continue
                if self.store.check([f"gen/{gen.number}/alive/{m}"]):
                    alive.add(m)
                elif m in gone:
                    lost.add(m)
            if len(alive) + len(lost) == len(gen.members):
                stay = [m for m in gen.members if m in alive]
                joined, admitted = self._admit(gen, int(self.store.add("joins", 0)),
                                               max(0, self.max_world - len(stay)))
                members = (*stay, *joined)
                self._publish(Generation(
                    gen.number + 1, members, members, admitted=admitted, reason="lost",
                    joined=joined, lost=tuple(m for m in gen.members if m in lost),
                    cluster=_resized(cluster, len(members)),
                    global_batch_size=global_batch_size, running=True))
                break
            if now > deadline:
                raise PeerTimeoutError(
                    f"{self.member} could not agree with the other survivors of generation "
                    f"{gen.number} within {self.timeout:.0f} s")
            time.sleep(0.05)
        new = self._record(gen.number + 1)
        if self.member not in new.members:
            raise DistributedError(
                f"{self.member} was counted lost by the other survivors of generation "
                f"{gen.number} (its heartbeat stopped for {self.window:.1f} s): it exits; its "
                "launcher may start it again, and it then joins as a new process")
        return new


class _Silence:
    """Whether every member of a generation stopped beating (checked about once a second)."""

    def __init__(self, membership: Membership, gen: Generation) -> None:
        self.m, self.gen = membership, gen
        self.last: dict[str, int] = {}
        self.moved = time.monotonic()
        self.checked = 0.0

    def all_gone(self) -> bool:
        now = time.monotonic()
        if not self.gen.members or not self.gen.running or now - self.checked < 1.0:
            return False
        self.checked = now
        beats = self.m.beats(list(self.gen.members))
        if beats != self.last:
            self.last, self.moved = beats, now
        return now - self.moved > self.m.window


def joining_running_job() -> bool:
    """This process was just admitted to a running in-place job (its state comes from the
    members, not from its own model)."""
    gen = _MEMBERSHIP.generation if _MEMBERSHIP is not None else None
    return gen is not None and gen.running and _MEMBERSHIP.member in gen.joined


def job_restarted() -> bool:
    """This process's generation starts an in-place job again after state was lost with its
    only holders (its script resumes from the latest checkpoint, or from step 0)."""
    gen = _MEMBERSHIP.generation if _MEMBERSHIP is not None else None
    return gen is not None and gen.restarted


def joined_settings() -> dict[str, Any]:
    """What a process joining a running job must plan with (the survivors' global batch)."""
    gen = _MEMBERSHIP.generation if _MEMBERSHIP is not None else None
    if gen is None or not gen.running:
        return {}
    return {"global_batch_size": gen.global_batch_size}


def _resized(cluster: dict[str, Any] | None, world: int) -> dict[str, Any] | None:
    """``cluster`` with ``world`` devices. ``gpus_per_node`` stays: it is the machines' size,
    not the world's (shrunk to a one-process world and grown back, it would say that the two
    processes sit on two machines, and the planner would price their replica link as slow:
    ZeRO-1's "auto" would then stop sharding, replica_sync "auto" would compress)."""
    if cluster is None or world < 1:
        return cluster
    return {**cluster, "gpus": world}


_MEMBERSHIP: Membership | None = None


def membership(timeout: float | None = None) -> Membership:
    """This process's membership (made from the launcher's environment on first use)."""
    global _MEMBERSHIP
    if _MEMBERSHIP is None:
        _MEMBERSHIP = Membership.from_env(300.0 if timeout is None else timeout)
    elif timeout is not None:
        _MEMBERSHIP.timeout = timeout
    return _MEMBERSHIP


def backend_name() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"
