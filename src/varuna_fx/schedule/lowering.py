"""Communication as schedule IR: every rank's action list with its sends and receives explicit.

:func:`lower` turns the compute actions of each rank (``Schedule.per_stage`` when every rank
holds one stage; any per-rank lists when a rank holds several) into a :class:`RankProgram`:

* after each compute action, the sends of what it produced: ``SEND_F`` (activations of a
  forward, to each downstream consumer stage) and ``SEND_B`` (input gradients of a backward, to
  each upstream producer stage whose values need a gradient);
* the receives each compute action takes, ``RECV_F`` / ``RECV_B``, posted ``lookahead`` compute
  actions ahead of it (the executor's ``LOOKAHEAD``), so a message lands while the rank still
  computes; the compute action then waits for them;
* a tail: the tied-weight and data-parallel all-reduces, the wait for every send, the wait for
  those reductions and the loss all-reduce over the world, in the order the runtime makes them.

A send or receive names its stage, micro-batch and peer stage: ``0SEND_F3>1`` (stage 0 sends
micro-batch 3's activations to stage 1), ``1RECV_B2<2`` (stage 1 receives micro-batch 2's
gradients from stage 2). A link between two stages on the same rank needs no message: the value
stays in the process. One op stands for every tensor of that link and micro-batch; the executor
sends and receives them in one order on both ends (transfer order), one after another, so
checking the bundles checks the tensors.

:func:`walk` is the one walk through a program that both the executor and the NCCL-order
checker (``nccl_check.py``) make, Varuna's run-time rule included: what is checked is what runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property

from varuna_fx.errors import ScheduleError
from varuna_fx.schedule.actions import Action, Kind, Schedule
from varuna_fx.schedule.cursor import Cursor

LOOKAHEAD = 3  # compute actions whose receives are posted ahead of the current one


class OpKind(str, Enum):
    """Compute (the letters of :class:`Kind`), point-to-point, and the step's tail."""

    F = "F"
    R = "R"
    B = "B"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    ALLREDUCE = "ALLREDUCE"  # a collective, issued (asynchronously) on its group
    WAIT_SENDS = "WAIT_SENDS"  # wait until every send of this rank completed
    WAIT_REDUCE = "WAIT_REDUCE"  # wait until every all-reduce issued so far completed

    def __str__(self) -> str:
        return self.value


COMPUTE = frozenset({OpKind.F, OpKind.R, OpKind.B, OpKind.W})
SENDS = frozenset({OpKind.SEND_F, OpKind.SEND_B})
RECVS = frozenset({OpKind.RECV_F, OpKind.RECV_B})

_P2P_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B)(\d+)([<>])(\d+)$")
_COMPUTE_RE = re.compile(r"^(\d+)([FRBW])(\d+)$")
_TAIL_RE = re.compile(r"^(ALLREDUCE)\(([a-z0-9+:]+)\)$|^(WAIT_SENDS|WAIT_REDUCE)$")


@dataclass(frozen=True)
class RankOp:
    """One operation of a rank: compute, a send or receive (``peer``: the other stage), or a
    tail collective (``group``: "tied:0+3", "dp:2", "world")."""

    kind: OpKind
    stage: int = -1
    mb: int = -1
    peer: int = -1
    group: str = ""

    @classmethod
    def compute(cls, action: Action) -> RankOp:
        return cls(OpKind(action.kind.value), action.stage, action.mb)

    @cached_property
    def action(self) -> Action:
        """The compute action (only for F, R, B, W)."""
        return Action(self.stage, Kind(self.kind.value), self.mb)

    @cached_property
    def message(self) -> tuple[str, int, int, int]:
        """What a send and its receive share: (F or B, sending stage, receiving stage, mb)."""
        direction = "F" if self.kind in (OpKind.SEND_F, OpKind.RECV_F) else "B"
        if self.kind in SENDS:
            return direction, self.stage, self.peer, self.mb
        return direction, self.peer, self.stage, self.mb

    def __str__(self) -> str:
        if self.kind in COMPUTE:
            return f"{self.stage}{self.kind}{self.mb}"
        if self.kind in SENDS:
            return f"{self.stage}{self.kind}{self.mb}>{self.peer}"
        if self.kind in RECVS:
            return f"{self.stage}{self.kind}{self.mb}<{self.peer}"
        if self.kind is OpKind.ALLREDUCE:
            return f"ALLREDUCE({self.group})"
        return str(self.kind)

    @classmethod
    def parse(cls, text: str) -> RankOp:
        text = text.strip()
        if m := _COMPUTE_RE.match(text):
            return cls(OpKind(m.group(2)), int(m.group(1)), int(m.group(3)))
        if m := _P2P_RE.match(text):
            kind = OpKind(m.group(2))
            if (m.group(4) == ">") != (kind in SENDS):
                raise ScheduleError(f"op {text!r}: a send names its peer after '>', a receive "
                                    "after '<'")
            return cls(kind, int(m.group(1)), int(m.group(3)), int(m.group(5)))
        if m := _TAIL_RE.match(text):
            if m.group(1):
                return cls(OpKind.ALLREDUCE, group=m.group(2))
            return cls(OpKind(m.group(3)))
        raise ScheduleError(
            f"cannot parse op {text!r}: expected e.g. '2F5', '0SEND_F3>1', '1RECV_B2<2', "
            "'ALLREDUCE(tied:0+3)', 'WAIT_SENDS'"
        )


@dataclass(frozen=True)
class Link:
    """Stage ``src`` sends values to stage ``dst``; ``gradient``: some need a gradient back."""

    src: int
    dst: int
    gradient: bool = True


def chain_links(num_stages: int) -> tuple[Link, ...]:
    """Every stage feeds the next, each value needing a gradient (a plain pipeline)."""
    return tuple(Link(s, s + 1) for s in range(num_stages - 1))


@dataclass
class RankProgram:
    """One rank's lowered step. ``before[k]``: ops issued just before compute action ``k``
    (receives posted ahead; ``before[n]`` after the last one); ``after[k]``: the sends of what
    compute action ``k`` produced; ``waits[k]``: the receives compute action ``k`` takes."""

    rank: int
    compute: list[Action]
    before: list[list[RankOp]]
    after: list[list[RankOp]]
    tail: list[RankOp]
    # filled by Lowered from its links
    waits: list[list[RankOp]] = field(default_factory=list, init=False, repr=False)
    index: dict[Action, int] = field(default_factory=dict, init=False, repr=False)
    compute_ops: list[RankOp] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.index = {a: k for k, a in enumerate(self.compute)}
        self.compute_ops = [RankOp.compute(a) for a in self.compute]

    @property
    def ops(self) -> list[RankOp]:
        """The static order: everything the rank issues, in the order it issues it."""
        out: list[RankOp] = []
        for k, op in enumerate(self.compute_ops):
            out += self.before[k]
            out.append(op)
            out += self.after[k]
        return out + self.before[len(self.compute)] + self.tail

    def backward_waits(self, k: int) -> list[RankOp]:
        """The receives of the backward that compute action ``k`` (a B or its R) feeds."""
        act = self.compute[k]
        b = self.index.get(Action(act.stage, Kind.B, act.mb))
        return self.waits[b] if b is not None else []


@dataclass
class Lowered:
    """Every rank's program for one step (``ranks[s]``: the rank of stage ``s`` in a replica;
    ``replicas``: data-parallel copies running the same programs on other ranks)."""

    name: str
    num_stages: int
    num_micro_batches: int
    split_backward: bool
    lookahead: int
    ranks: tuple[int, ...]
    replicas: int
    programs: list[RankProgram]
    links: tuple[Link, ...] = ()

    def __post_init__(self) -> None:
        # what each compute action takes follows from the links, not from the receives the
        # text happens to hold: an action whose receive is missing waits for it (and hangs)
        into, out = _by_stage(self.links)
        for prog in self.programs:
            prog.waits = [_receives(a, into, out, self.ranks) for a in prog.compute]

    def __str__(self) -> str:
        split = " split_backward" if self.split_backward else ""
        links = "" if self.links == chain_links(self.num_stages) else \
            " links=" + ",".join(f"{k.src}>{k.dst}{'' if k.gradient else '~'}" for k in self.links)
        lines = [f"# {self.name} P={self.num_stages} m={self.num_micro_batches} lookahead="
                 f"{self.lookahead} ranks={','.join(map(str, self.ranks))} replicas="
                 f"{self.replicas}{split}{links}"]
        for prog in self.programs:
            lines.append(f"rank {prog.rank}: {' '.join(map(str, prog.ops))}".rstrip())
        return "\n".join(lines) + "\n"

    @classmethod
    def parse(cls, text: str) -> Lowered:
        """Read the text form produced by ``str()``."""
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        header = _HEADER_RE.match(lines[0]) if lines else None
        if header is None:
            raise ScheduleError(
                "bad lowered-schedule header: expected '# <name> P=<P> m=<m> lookahead=<n> "
                "ranks=<rank of each stage> replicas=<D> [split_backward] [links=...]'"
            )
        name, p, m, ahead, ranks_text, d, split, links_text = header.groups()
        ranks = tuple(int(r) for r in ranks_text.split(","))
        links = chain_links(int(p)) if links_text is None else tuple(
            Link(int(a), int(b.rstrip("~")), not b.endswith("~"))
            for a, b in (tok.split(">") for tok in links_text.split(",")))
        programs = []
        for line in lines[1:]:
            match = re.match(r"^rank\s+(\d+):(.*)$", line)
            if match is None or int(match.group(1)) != len(programs):
                raise ScheduleError(f"bad line {line!r}: expected 'rank {len(programs)}: <ops>'")
            programs.append(_program(int(match.group(1)),
                                     [RankOp.parse(t) for t in match.group(2).split()]))
        return cls(name, int(p), int(m), split is not None, int(ahead), ranks, int(d),
                   programs, links)


_HEADER_RE = re.compile(
    r"^#\s*(\S+)\s+P=(\d+)\s+m=(\d+)\s+lookahead=(\d+)\s+ranks=([\d,]+)\s+replicas=(\d+)"
    r"(\s+split_backward)?(?:\s+links=(\S+))?\s*$"
)


def _program(rank: int, ops: list[RankOp]) -> RankProgram:
    """A program from its flat order: the sends right after a compute action that carry what
    it produced are its ``after``; everything else goes before the next compute action."""
    compute: list[Action] = []
    before: list[list[RankOp]] = [[]]
    after: list[list[RankOp]] = []
    tail: list[RankOp] = []
    for op in ops:
        if op.kind in COMPUTE:
            if tail:
                raise ScheduleError(f"rank {rank}: {op} comes after the step's tail ({tail[0]})")
            compute.append(op.action)
            after.append([])
            before.append([])
        elif op.kind in (OpKind.ALLREDUCE, OpKind.WAIT_SENDS, OpKind.WAIT_REDUCE):
            tail.append(op)
        elif tail:
            raise ScheduleError(f"rank {rank}: {op} comes after the step's tail ({tail[0]})")
        elif compute and not before[-1] and op.kind in SENDS and _produces(compute[-1], op):
            after[-1].append(op)
        else:
            before[-1].append(op)
    return RankProgram(rank, compute, before, after, tail)


def _produces(action: Action, send: RankOp) -> bool:
    """Whether ``send`` carries what ``action`` computed."""
    kind = Kind.F if send.kind is OpKind.SEND_F else Kind.B
    return (action.stage, action.kind, action.mb) == (send.stage, kind, send.mb)


def lower(per_rank: Sequence[Sequence[Action]], ranks: Sequence[int], num_micro_batches: int,
          *, name: str = "custom", split_backward: bool = False,
          links: Sequence[Link] | None = None, lookahead: int = LOOKAHEAD,
          tied: Sequence[Sequence[int]] = (), replicas: int = 1) -> Lowered:
    """Lower each rank's compute actions (``per_rank[r]``, which may mix several stages) to
    its program. ``ranks[s]``: the rank of stage ``s``; ``links``: which stages send to which
    (default: a chain); ``tied``: the holder stages of each tied-parameter set (one all-reduce
    each); ``replicas``: D (a data-parallel all-reduce per stage when D > 1)."""
    num_stages = len(ranks)
    links = tuple(sorted(chain_links(num_stages) if links is None else links,
                         key=lambda k: (k.src, k.dst)))
    for k in links:
        if not (0 <= k.src < num_stages and 0 <= k.dst < num_stages and k.src != k.dst):
            raise ScheduleError(f"link {k.src}>{k.dst} names a stage outside 0..{num_stages - 1}")
    into, out = _by_stage(links)
    programs = []
    for r, actions in enumerate(per_rank):
        n = len(actions)
        before: list[list[RankOp]] = [[] for _ in range(n + 1)]
        after: list[list[RankOp]] = [[] for _ in range(n)]
        for k, a in enumerate(actions):
            s, i = a.stage, a.mb
            if ranks[s] != r:
                raise ScheduleError(f"rank {r}'s list holds {a}, but stage {s} is on rank "
                                    f"{ranks[s]}")
            if a.kind is Kind.F:
                after[k] = [RankOp(OpKind.SEND_F, s, i, k_.dst) for k_ in out.get(s, ())
                            if ranks[k_.dst] != r]
            elif a.kind is Kind.B:
                after[k] = [RankOp(OpKind.SEND_B, s, i, k_.src) for k_ in into.get(s, ())
                            if k_.gradient and ranks[k_.src] != r]
            before[max(0, k - lookahead)] += _receives(a, into, out, ranks)
        here = sorted({a.stage for a in actions})
        programs.append(RankProgram(r, list(actions), before, after,
                                    _tail(here, tied, replicas)))
    return Lowered(name, num_stages, num_micro_batches, split_backward, lookahead,
                   tuple(ranks), replicas, programs, links)


def _by_stage(links: Sequence[Link]) -> tuple[dict[int, list[Link]], dict[int, list[Link]]]:
    """(links into each stage, links out of each stage), in (src, dst) order."""
    into: dict[int, list[Link]] = {}
    out: dict[int, list[Link]] = {}
    for k in sorted(links, key=lambda k: (k.src, k.dst)):
        into.setdefault(k.dst, []).append(k)
        out.setdefault(k.src, []).append(k)
    return into, out


def _receives(action: Action, into: dict[int, list[Link]], out: dict[int, list[Link]],
              ranks: Sequence[int]) -> list[RankOp]:
    """The receives ``action`` takes: a forward the activations from every upstream stage on
    another rank, a backward the gradients from every such downstream stage."""
    s, i, r = action.stage, action.mb, ranks[action.stage]
    if action.kind is Kind.F:
        return [RankOp(OpKind.RECV_F, s, i, k.src) for k in into.get(s, ()) if ranks[k.src] != r]
    if action.kind is Kind.B:
        return [RankOp(OpKind.RECV_B, s, i, k.dst) for k in out.get(s, ())
                if k.gradient and ranks[k.dst] != r]
    return []


def _tail(stages: list[int], tied: Sequence[Sequence[int]], replicas: int) -> list[RankOp]:
    """After the last compute action, as ``DistributedRuntime.run_actions`` and ``finish``:
    start the tied sums (one group per holder set, in sorted order) and the data-parallel
    average, wait for the sends, wait for the reductions, then the loss all-reduce."""
    ops = [RankOp(OpKind.ALLREDUCE, group="tied:" + "+".join(map(str, h)))
           for h in sorted(tuple(sorted(h)) for h in tied) if set(h) & set(stages)]
    if replicas > 1:  # one per rank: its group averages every stage it holds (virtual stages)
        ops.append(RankOp(OpKind.ALLREDUCE, group=f"dp:{min(stages)}"))
    return ops + [RankOp(OpKind.WAIT_SENDS), RankOp(OpKind.WAIT_REDUCE),
                  RankOp(OpKind.ALLREDUCE, group="world"), RankOp(OpKind.WAIT_REDUCE)]


def lower_schedule(schedule: Schedule, *, links: Sequence[Link] | None = None,
                   lookahead: int = LOOKAHEAD, tied: Sequence[Sequence[int]] = (),
                   replicas: int = 1, ranks: Sequence[int] | None = None,
                   per_rank: Sequence[Sequence[Action]] | None = None) -> Lowered:
    """:func:`lower` for a :class:`Schedule`: one stage per rank unless ``ranks`` (the rank of
    each stage) and ``per_rank`` (each rank's merged order of its stages' actions) say."""
    if ranks is None:  # a virtual schedule knows its placement and each rank's order
        ranks = list(schedule.stage_ranks or range(schedule.num_stages))
        per_rank = schedule.rank_lists if per_rank is None else per_rank
    if per_rank is None:
        if len(set(ranks)) != len(ranks):
            raise ScheduleError("several stages share a rank: pass per_rank, each rank's order "
                                "of its stages' actions")
        per_rank = [[] for _ in range(max(ranks) + 1)]
        for s, acts in enumerate(schedule.per_stage):
            per_rank[ranks[s]] = list(acts)
    return lower(per_rank, ranks, schedule.num_micro_batches, name=schedule.name,
                 split_backward=schedule.split_backward, links=links, lookahead=lookahead,
                 tied=tied, replicas=replicas)


def walk(program: RankProgram, split: bool, reorder: bool,
         landed: Callable[[RankOp], bool]) -> Walk:
    """The ops of ``program`` in the order the rank issues them, each yielded when it is due
    (resume the generator once it ran). With ``reorder`` (Varuna's run-time rule,
    ``runtime/opportunistic.py``), when the next action is a backward (or its recompute) whose
    gradients have not ``landed`` and the next forward's inputs have, that forward runs first,
    with its sends; receives are still posted in the static order. ``landed`` is asked only
    about receives already yielded."""
    return Walk(program, split, reorder, landed)


class Walk:
    """:func:`walk`'s iterable; it keeps its :class:`Cursor` (jumped forwards, peak held)."""

    def __init__(self, program: RankProgram, split: bool, reorder: bool,
                 landed: Callable[[RankOp], bool]) -> None:
        self.program, self.reorder, self.landed = program, reorder, landed
        self.cursor = Cursor(program.compute, split)

    def __iter__(self) -> Iterator[RankOp]:
        prog, cursor, landed = self.program, self.cursor, self.landed
        posted = 0  # before-lists issued so far

        def post_through(k: int) -> Iterator[RankOp]:
            nonlocal posted
            while posted <= k:
                yield from prog.before[posted]
                posted += 1

        while (k := cursor.head()) is not None:
            yield from post_through(k)
            if self.reorder:
                f = cursor.ahead()
                # the executor's order of questions: the gradient first, then (posting the
                # static receives up to that forward) its inputs
                if f is not None and not all(landed(op) for op in prog.backward_waits(k)):
                    yield from post_through(f)
                    if all(landed(op) for op in prog.waits[f]):
                        k = f
            yield prog.compute_ops[k]
            cursor.done(k)
            yield from prog.after[k]
        yield from post_through(len(prog.compute))
        yield from prog.tail
