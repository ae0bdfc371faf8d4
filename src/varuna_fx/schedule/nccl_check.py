"""Prove a lowered schedule deadlock-free under NCCL's rules, by running it abstractly.

NCCL's rules, as modelled here:

* **One FIFO per communicator per rank.** The operations a rank issues on one communicator run
  on that communicator's stream, one after another, in issue order; an operation cannot start
  before the one issued ahead of it on the same communicator has finished.
* **Blocking matches.** A send runs only together with its receive: both must be at the head of
  their ranks' FIFOs. The n-th send from rank a to rank b on a communicator is paired with b's
  n-th receive from a there; NCCL carries no tags, so if those two are different messages it
  pairs them anyway (wrong data, or a hang on a size mismatch): reported as an error at once.
* A collective runs once every member has it at the head of that communicator's FIFO.
* Issuing is asynchronous (``isend`` / ``irecv`` / ``all_reduce(async_op=True)``); a rank
  blocks where it waits: a compute action for the receives it takes, ``WAIT_SENDS`` /
  ``WAIT_REDUCE`` for what they name. Waits are modelled as blocking the host, which is
  stricter than CUDA streams (a rank that runs here also runs there).

Communicator layout (``layout``). ``"stage-direction"`` is the runtime's (``runtime/setup.py``):
one two-rank group per (sending stage, receiving stage) direction per replica, whose
point-to-point traffic PyTorch runs on one NCCL communicator (ProcessGroupNCCL keys a lazily
made two-rank communicator, with its own stream, by the rank pair); the tied sets, each stage's
data-parallel replicas and the world (the loss) have groups of their own. With one stage per
rank it equals ``"rank-direction"`` (one per sending rank, receiving rank); with several stages
per rank the latter would put a V-shape's activations 0>1 and gradients 3>2 on one FIFO, and the
receiving rank posts them in another order than the sender sends (the tests show it).
``"rank-pair"``: one communicator per rank pair, both directions (what the default group gives
without the direction groups); ``"single"``: one communicator for all point-to-point traffic (a
default group initialised with ``device_id``). The others exist to show what the runtime's
groups buy.

``reorder``: each rank walks its program with Varuna's run-time rule (``lowering.walk``, the
executor's own walk), where "landed" means the receive has completed in this run; ``seed``
makes the interleaving of ranks and completions random (None: every rank runs as far as it can
before any transfer completes, so gradients look as late as possible and forwards jump most).

What it found: with one stage per rank, the runtime's direction groups are what make every
schedule safe (on one communicator per rank pair 1F1B P=2 hangs: stage 0's posted receive of
gradient 0 sits ahead of its send of activation 1, which stage 1 needs before it sends that
gradient), and blocking ``dist.send``/``recv`` would hang at the first posted receive. With
several stages per rank (V-shape 0,1,1,0 or looped 0,1,0,1) groups keyed by rank pair would
mis-pair a gradient 3>2 with an activation 0>1 on one FIFO, so ``Groups.links`` is keyed by
stage pair. Model limits: several communicators progress independently, which NCCL promises
only while their kernels fit on the GPU together (NCCL's "using multiple communicators
concurrently" caveat); the evaluation forward and ``clip_grad_norm_``'s pipeline all-reduce are
not lowered. Tests: ``tests/schedule/test_nccl_order.py``.
"""

from __future__ import annotations

import gc
import random
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from varuna_fx.errors import ScheduleError
from varuna_fx.schedule.actions import Action, Kind, Schedule
from varuna_fx.schedule.lowering import (
    COMPUTE,
    RECVS,
    SENDS,
    Link,
    Lowered,
    OpKind,
    RankOp,
    Walk,
    lower_schedule,
)

LAYOUTS = ("stage-direction", "rank-direction", "rank-pair", "single")
Proc = tuple[int, int]  # (pipeline rank, replica)


@dataclass(eq=False)
class _Entry:
    """One issued communication of one rank."""

    proc: Proc
    op: RankOp
    comm: tuple
    channel: tuple | None = None  # p2p: (comm, sending proc, receiving proc)
    partner: _Entry | None = None  # p2p: its match, once both are issued
    seq: int = 0
    done: bool = False


@dataclass
class CommRun:
    """What one checked run did: the forwards each rank ran ahead of their place."""

    jumped: dict[Proc, list[Action]] = field(default_factory=dict)
    rounds: int = 0


class _Run:
    def __init__(self, lowered: Lowered, layout: str, reorder: bool, seed: int | None,
                 blocking: bool, late: bool) -> None:
        if layout not in LAYOUTS:
            raise ScheduleError(f"unknown communicator layout {layout!r}; choose one of "
                                f"{', '.join(LAYOUTS)}")
        self.lowered, self.layout, self.blocking, self.late = lowered, layout, blocking, late
        self.rng = random.Random(seed) if seed is not None else None
        d = lowered.replicas
        self.procs: list[Proc] = [(p.rank, r) for r in range(d) for p in lowered.programs]
        self.program = {(p.rank, r): p for r in range(d) for p in lowered.programs}
        self.queues: dict[tuple[Proc, tuple], deque[_Entry]] = {}
        self.issued: dict[tuple[Proc, RankOp], _Entry] = {}
        self.channels: dict[tuple, tuple[list[_Entry], list[_Entry]]] = {}
        self.collectives: dict[tuple, list[list[_Entry]]] = {}
        self.computed: set[tuple[Proc, Action]] = set()
        self.mine: dict[Proc, list[_Entry]] = {p: [] for p in self.procs}
        self.open_sends = {p: 0 for p in self.procs}  # issued, not yet complete
        self.open_reduces = {p: 0 for p in self.procs}
        self.dirty: set[tuple[Proc, tuple]] = set()  # FIFOs whose head may now match
        self.counts: dict[tuple[Proc, tuple], int] = {}  # collectives issued per FIFO
        local = [k for k in lowered.links if lowered.ranks[k.src] == lowered.ranks[k.dst]]
        self.local_into = {k.dst: [] for k in local}
        self.local_out = {k.src: [] for k in local}
        for k in local:
            self.local_into[k.dst].append(k)
            self.local_out[k.src].append(k)
        self.walks = {p: Walk(self.program[p], lowered.split_backward, reorder,
                              lambda op, p=p: self._landed(p, op)) for p in self.procs}
        self.iters: dict[Proc, Iterator[RankOp]] = {p: iter(w) for p, w in self.walks.items()}
        self.pending: dict[Proc, RankOp | None] = {p: next(self.iters[p], None) for p in self.procs}
        self.waiting: dict[Proc, _Entry | None] = {p: None for p in self.procs}  # blocking

    # -- state ---------------------------------------------------------------------------------

    def _landed(self, proc: Proc, op: RankOp) -> bool:
        if self.late and op.kind is OpKind.RECV_B:
            return False  # the adversary: every gradient is late, so forwards jump most
        entry = self.issued.get((proc, op))
        return entry is not None and entry.done

    def _rank_of_stage(self, stage: int) -> int:
        return self.lowered.ranks[stage]

    def _name(self, proc: Proc) -> str:
        return f"rank {proc[0]}" if self.lowered.replicas == 1 else \
            f"rank {proc[0]} of replica {proc[1]}"

    def _p2p_comm(self, sender: Proc, receiver: Proc, op: RankOp) -> tuple:
        a, b, rep = sender[0], receiver[0], sender[1]
        if self.layout == "stage-direction":
            _, src, dst, _ = op.message
            return ("p2p", src, dst, rep)
        if self.layout == "rank-direction":
            return ("p2p", a, b, rep)
        if self.layout == "rank-pair":
            return ("p2p", min(a, b), max(a, b), rep)
        return ("p2p",)

    def _describe(self, comm: tuple) -> str:
        if len(comm) == 1:
            return "one point-to-point communicator"
        sep = "-" if self.layout == "rank-pair" else ">"
        unit = "stage" if self.layout == "stage-direction" else "rank"
        return f"{unit} {comm[1]}{sep}{comm[2]} communicator"

    def _members(self, group: str) -> tuple[tuple, list[Proc]]:
        reps = range(self.lowered.replicas)
        kind, _, rest = group.partition(":")
        if kind == "world":
            return ("world",), list(self.procs)
        if kind == "tied":
            holders = [int(s) for s in rest.split("+")]
            ranks = sorted({self._rank_of_stage(s) for s in holders})
            return ("tied", rest), [(r, d) for d in reps for r in ranks]
        if kind == "dp":
            return ("dp", rest), [(self._rank_of_stage(int(rest)), d) for d in reps]
        raise ScheduleError(f"unknown all-reduce group {group!r}: expected 'tied:<s>+<s>', "
                            "'dp:<stage>' or 'world'")

    # -- issuing -------------------------------------------------------------------------------

    def _issue(self, proc: Proc, op: RankOp) -> _Entry:
        if (proc, op) in self.issued:
            raise ScheduleError(f"{self._name(proc)} issues {op} twice")
        if op.kind is OpKind.ALLREDUCE:
            comm, members = self._members(op.group)
            if proc not in members:
                raise ScheduleError(f"{self._name(proc)} issues {op} but holds no stage of it")
            entry = _Entry(proc, op, comm)
            rounds = self.collectives.setdefault(comm, [])
            seq = self.counts.get((proc, comm), 0)
            self.counts[(proc, comm)] = seq + 1
            if seq == len(rounds):
                rounds.append([])
            rounds[seq].append(entry)
            entry.seq = seq
            if any(e.op != op for e in rounds[seq]):
                other = next(e for e in rounds[seq] if e.op != op)
                raise ScheduleError(f"NCCL pairs {self._name(proc)}'s {op} with "
                                    f"{self._name(other.proc)}'s {other.op} on one communicator")
        else:
            peer = (self._rank_of_stage(op.peer), proc[1])
            sender, receiver = (proc, peer) if op.kind in SENDS else (peer, proc)
            comm = self._p2p_comm(sender, receiver, op)
            channel = (comm, sender, receiver)
            sends, recvs = self.channels.setdefault(channel, ([], []))
            side, other = (sends, recvs) if op.kind in SENDS else (recvs, sends)
            entry = _Entry(proc, op, comm, channel, seq=len(side))
            side.append(entry)
            if entry.seq < len(other):
                match = other[entry.seq]
                if match.op.message != op.message:
                    raise ScheduleError(
                        f"NCCL pairs {self._name(proc)}'s {op} with {self._name(match.proc)}'s "
                        f"{match.op}: each is number {entry.seq} on its side from "
                        f"{self._name(sender)} to {self._name(receiver)} on one communicator, "
                        "and NCCL matches by order only (wrong data or a hang); issue them in "
                        "the same order on both ends"
                    )
                entry.partner, match.partner = match, entry
                self.dirty.add((match.proc, match.comm))
        self.issued[(proc, op)] = entry
        self.mine[proc].append(entry)
        if op.kind in SENDS:
            self.open_sends[proc] += 1
        elif op.kind is OpKind.ALLREDUCE:
            self.open_reduces[proc] += 1
        self.queues.setdefault((proc, entry.comm), deque()).append(entry)
        self.dirty.add((proc, entry.comm))
        return entry

    # -- one rank's next op --------------------------------------------------------------------

    def _blocker(self, proc: Proc, op: RankOp, explain: bool = False) -> str | None:
        """Why ``op`` cannot run now (None: it can; ``explain``: say it in full)."""
        waiting = self.waiting[proc]
        if waiting is not None:
            if waiting.done:
                return None
            return f"its {waiting.op} to complete" if explain else "blocking"
        if op.kind in COMPUTE:
            prog = self.program[proc]
            k = prog.index[op.action]
            for recv in prog.waits[k]:
                entry = self.issued.get((proc, recv))
                if entry is None:
                    return f"{recv}, which it has not posted yet" if explain else "unposted"
                if not entry.done:
                    return str(recv) if explain else "receive"
            for dep in self._local_deps(op.action):
                if (proc, dep) not in self.computed:
                    return f"{dep} on this rank" if explain else "local"
            return None
        if op.kind is OpKind.WAIT_SENDS:
            if not self.open_sends[proc]:
                return None
            if not explain:
                return "sends"
            left = [e.op for e in self.mine[proc] if e.op.kind in SENDS and not e.done]
            return f"its sends ({' '.join(map(str, left[:3]))})"
        if op.kind is OpKind.WAIT_REDUCE:
            if not self.open_reduces[proc]:
                return None
            if not explain:
                return "reductions"
            left = [e.op for e in self.mine[proc] if e.op.kind is OpKind.ALLREDUCE and not e.done]
            return f"{' '.join(map(str, left[:3]))}"
        return None

    def _local_deps(self, action: Action) -> list[Action]:
        s, i = action.stage, action.mb
        if action.kind is Kind.F:
            return [Action(k.src, Kind.F, i) for k in self.local_into.get(s, ())]
        if action.kind is Kind.B:
            return [Action(k.dst, Kind.B, i) for k in self.local_out.get(s, ()) if k.gradient]
        return []

    def advance(self, proc: Proc) -> bool:
        op = self.pending[proc]
        if op is None or self._blocker(proc, op) is not None:
            return False
        if self.waiting[proc] is not None:
            self.waiting[proc] = None
        elif op.kind in COMPUTE:
            self.computed.add((proc, op.action))
        elif op.kind in SENDS or op.kind in RECVS or op.kind is OpKind.ALLREDUCE:
            if op.kind in SENDS:
                kind = Kind.F if op.kind is OpKind.SEND_F else Kind.B
                if (proc, Action(op.stage, kind, op.mb)) not in self.computed:
                    raise ScheduleError(f"{self._name(proc)} issues {op} before computing "
                                        f"{Action(op.stage, kind, op.mb)}, which it carries")
            entry = self._issue(proc, op)
            if self.blocking and op.kind is not OpKind.ALLREDUCE:
                self.waiting[proc] = entry  # dist.send / dist.recv: the host waits here
                return True
        self.pending[proc] = next(self.iters[proc], None)
        return True

    # -- communicators -------------------------------------------------------------------------

    def ready(self) -> list[list[_Entry]]:
        """Groups of entries that can complete now: all at the heads of their FIFOs."""
        out = []
        seen: set[int] = set()
        dirty, self.dirty = self.dirty, set()
        for key in dirty:
            queue = self.queues.get(key)
            if not queue or id(queue[0]) in seen:
                continue
            head = queue[0]
            if head.channel is not None:
                p = head.partner
                if p is not None and self._at_head(p):
                    seen.update((id(head), id(p)))
                    out.append([head, p])
            else:
                group = self.collectives[head.comm][head.seq]
                _, members = self._members(head.op.group)
                if len(group) == len(members) and all(self._at_head(e) for e in group):
                    seen.update(id(e) for e in group)
                    out.append(group)
        return out

    def _at_head(self, entry: _Entry) -> bool:
        queue = self.queues[(entry.proc, entry.comm)]
        return bool(queue) and queue[0] is entry

    def complete(self, group: list[_Entry]) -> None:
        for e in group:
            e.done = True
            self.queues[(e.proc, e.comm)].popleft()
            self.dirty.add((e.proc, e.comm))
            if e.op.kind in SENDS:
                self.open_sends[e.proc] -= 1
            elif e.op.kind is OpKind.ALLREDUCE:
                self.open_reduces[e.proc] -= 1

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> CommRun:
        result = CommRun()
        while True:
            moved = False
            procs = list(self.procs)
            if self.rng is not None:
                self.rng.shuffle(procs)
            for proc in procs:
                budget = self.rng.randint(1, 6) if self.rng is not None else -1
                while budget != 0 and self.advance(proc):
                    moved = True
                    budget -= 1
            ready = self.ready()
            if self.rng is not None and ready:
                keep = self.rng.randint(0 if moved else 1, len(ready))
                chosen = self.rng.sample(ready, keep)
                for group in ready:  # the others complete later: look at them again
                    if not any(group is c for c in chosen):
                        self.dirty.update((e.proc, e.comm) for e in group)
                ready = chosen
            for group in ready:
                self.complete(group)
            result.rounds += 1
            if not moved and not ready:
                break
        if any(op is not None for op in self.pending.values()):
            raise ScheduleError(self._stuck())
        left = [e for q in self.queues.values() for e in q]
        if left:
            raise ScheduleError(
                f"NCCL-order check of {self.lowered.name}: every rank finished but "
                f"{', '.join(f'{self._name(e.proc)} {e.op}' for e in left[:4])} never matched"
            )
        result.jumped = {p: list(w.cursor.jumped) for p, w in self.walks.items()}
        return result

    def _stuck(self) -> str:
        parts = []
        for proc in self.procs:
            op = self.pending[proc]
            if op is None:
                continue
            why = self._blocker(proc, op, explain=True)
            parts.append(f"{self._name(proc)} waits at {op} for {why}")
        heads = []
        for (proc, _comm), queue in self.queues.items():
            if queue:
                e = queue[0]
                if e.channel is not None:
                    peer = e.channel[2] if e.proc == e.channel[1] else e.channel[1]
                    q = self.queues.get((peer, e.comm))
                    other = str(q[0].op) if q else "nothing"
                    heads.append(f"{self._name(proc)}'s next op on the {self._describe(e.comm)}"
                                 f" is {e.op}, {self._name(peer)}'s is {other}")
                else:
                    heads.append(f"{self._name(proc)}'s {e.op} waits for the other members")
        return (f"NCCL-order deadlock in {self.lowered.name} ({self.layout} communicators): "
                + "; ".join(parts) + (". Communicator heads: " + "; ".join(heads[:6])
                                      if heads else ""))


def check_comms(lowered: Lowered, *, layout: str = "stage-direction", reorder: bool = False,
                seed: int | None = None, blocking: bool = False, late: bool = False
                ) -> CommRun:
    """Run every rank's program (``lowered.replicas`` copies) under NCCL's rules; raise
    :class:`ScheduleError` naming the first stuck operations if it cannot finish.
    ``blocking``: sends and receives block the host until matched (``dist.send`` /
    ``dist.recv``) instead of being issued asynchronously. ``late`` (with ``reorder``): the rule
    sees every gradient as not yet arrived, so a forward jumps wherever its inputs have landed
    and the stash cap allows (a gradient can always be that late on a slow link)."""
    # the run allocates tens of thousands of small objects that all live until it ends: the
    # cyclic collector's passes over them took up to half its time (P=16, m=64)
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _Run(lowered, layout, reorder, seed, blocking, late).run()
    finally:
        if enabled:
            gc.enable()


def check_schedule_comms(schedule: Schedule, *, links: Sequence[Link] | None = None,
                         tied: Sequence[Sequence[int]] = (), replicas: int = 1,
                         seeds: Sequence[int | None] = (None, 0, 1, 2),
                         layout: str = "stage-direction") -> Lowered:
    """Lower ``schedule`` and check it statically and with the run-time rule's reorderings
    (per seed: one run as timing falls, one with every gradient late); returns the lowered
    schedule."""
    lowered = lower_schedule(schedule, links=links, tied=tied, replicas=replicas)
    check_comms(lowered, layout=layout)
    for seed in seeds:
        check_comms(lowered, layout=layout, reorder=True, seed=seed)
        check_comms(lowered, layout=layout, reorder=True, seed=seed, late=True)
    return lowered
