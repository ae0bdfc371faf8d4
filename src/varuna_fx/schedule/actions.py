"""Actions and schedules: the vocabulary shared by generators, validator, simulator and runtime.

An :class:`Action` is one unit of pipeline work, ``(stage, kind, micro_batch)``, printed compactly
as ``2F5``. A :class:`Schedule` is one ordered action list per stage; its text form is the golden
file format (a header line, then one line per stage) and :meth:`Schedule.parse` reads it back.

Split backward (zero-bubble style, ``Schedule.split_backward``): the backward is cut in two. ``B``
then computes only the gradients of the stage's *inputs* (what the upstream stage waits for) and
``W`` later computes the gradients of the stage's *weights*, which nobody waits for, so a ``W``
can fill time a stage would otherwise sit idle.

Recompute may differ per stage: ``Schedule.recompute`` is one bool for all stages but the last
(which never recomputes), or a tuple with one bool per stage; :meth:`Schedule.recomputes` answers
for one stage.

Virtual stages (several stages per rank, ``virtual.py``): ``Schedule.stage_ranks[s]`` is the
pipeline rank running stage ``s`` and ``Schedule.ranks`` holds one ordered list per rank, which
interleaves the actions of its stages; ``per_stage`` is then derived (each stage's actions in
its rank's order), so everything that reads one stage's order still works. Without them (one
stage per rank) ``lists`` is ``per_stage``. Text form: ``placement=0,1,1,0`` in the header and one
``rank r:`` line per rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from varuna_fx.errors import ScheduleError

_ACTION_RE = re.compile(r"^(\d+)([FRBW])(\d+)$")
_HEADER_RE = re.compile(
    r"^#\s*(.+?)\s+P=(\d+)\s+m=(\d+)\s+recompute=(True|False|[01]+)(\s+split_backward)?"
    r"(?:\s+placement=([\d,]+))?\s*$"
)
_STAGE_RE = re.compile(r"^stage\s+(\d+):(.*)$")
_RANK_RE = re.compile(r"^rank\s+(\d+):(.*)$")


class Kind(str, Enum):
    """What an action does: forward, recompute (replay the forward from stashed inputs), backward
    (in a split-backward schedule: the input-gradient part only), weight-gradient part."""

    F = "F"
    R = "R"
    B = "B"
    W = "W"

    def __str__(self) -> str:
        # (str, Enum) would print "Kind.F"; the compact action syntax needs the bare letter.
        return self.value


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: run ``kind`` for micro-batch ``mb`` on pipeline stage ``stage``."""

    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.mb}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the compact form produced by ``str()``, e.g. ``"2F5"``."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected <stage><F|R|B|W><micro-batch>, e.g. '2F5'"
            )
        return cls(int(match.group(1)), Kind(match.group(2)), int(match.group(3)))


@dataclass(eq=True)
class Schedule:
    """Per-stage ordered action lists for ``num_stages`` stages and ``num_micro_batches``;
    with virtual stages also the per-rank lists and which rank runs each stage."""

    name: str
    num_stages: int
    num_micro_batches: int
    recompute: bool | tuple[bool, ...]
    per_stage: list[list[Action]]
    split_backward: bool = False
    # virtual stages: the pipeline rank of each stage, and each rank's ordered list (the
    # per-stage lists are then derived from these); None: stage s is rank s
    stage_ranks: tuple[int, ...] | None = None
    rank_lists: list[list[Action]] | None = None
    # Compiled simulation data (kept by structure.compiled); not part of the schedule's identity.
    compiled_form: Any = field(default=None, init=False, repr=False, compare=False)
    # The ScheduleCosts a cost-aware order was generated from (None: parsed or unit costs).
    costs: Any = field(default=None, init=False, repr=False, compare=False)
    # The registry entry it was built from (a ``registry.ScheduleSpec``; None: parsed or made
    # by hand): what its holders ask about its kind, instead of decoding ``name``.
    spec: Any = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def virtual(cls, name: str, num_stages: int, num_micro_batches: int,
                recompute: bool | tuple[bool, ...], stage_ranks: tuple[int, ...],
                rank_lists: list[list[Action]], split_backward: bool = False) -> Schedule:
        """A schedule whose ranks run several stages: ``rank_lists[r]`` in order on rank r,
        ``stage_ranks[s]`` the rank of stage s; ``per_stage`` is derived from them."""
        per_stage: list[list[Action]] = [[] for _ in range(num_stages)]
        for acts in rank_lists:
            for a in acts:
                if 0 <= a.stage < num_stages:
                    per_stage[a.stage].append(a)
        return cls(name, num_stages, num_micro_batches, recompute, per_stage, split_backward,
                   tuple(stage_ranks), [list(acts) for acts in rank_lists])

    @property
    def is_virtual(self) -> bool:
        """Whether some rank runs several stages (``rank_lists`` is set)."""
        return self.rank_lists is not None

    @property
    def lists(self) -> list[list[Action]]:
        """What each rank runs, in order: ``rank_lists``, or ``per_stage`` (one stage per rank)."""
        return self.per_stage if self.rank_lists is None else self.rank_lists

    @property
    def num_ranks(self) -> int:
        return len(self.lists)

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that runs ``stage``."""
        return stage if self.stage_ranks is None else self.stage_ranks[stage]

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // max(1, self.num_ranks)

    def recomputes(self, stage: int) -> bool:
        """Whether ``stage`` replays its forward before each backward (never the last stage)."""
        if stage >= self.num_stages - 1:
            return False
        if isinstance(self.recompute, bool):
            return self.recompute
        return bool(self.recompute[stage])

    @property
    def recompute_stages(self) -> tuple[bool, ...]:
        """One bool per stage: :meth:`recomputes` for every stage."""
        return tuple(self.recomputes(s) for s in range(self.num_stages))

    @property
    def actions(self) -> list[Action]:
        """All actions, stage by stage (not an execution order; see ``execution_order``)."""
        return [a for stage in self.per_stage for a in stage]

    def __repr__(self) -> str:
        # compact: a Plan's repr shows its schedule; str() gives the full action lists
        ranks = "" if self.rank_lists is None else f", ranks={self.num_ranks}"
        return (f"Schedule({self.name!r}, P={self.num_stages}, m={self.num_micro_batches}, "
                f"recompute={self.recompute}{ranks})")

    def __str__(self) -> str:
        rc = self.recompute if isinstance(self.recompute, bool) else \
            "".join(str(int(r)) for r in self.recompute)
        split = " split_backward" if self.split_backward else ""
        where = "" if self.stage_ranks is None else \
            " placement=" + ",".join(str(r) for r in self.stage_ranks)
        lines = [f"# {self.name} P={self.num_stages} m={self.num_micro_batches} recompute={rc}"
                 f"{split}{where}"]
        label = "stage" if self.rank_lists is None else "rank"
        for s, acts in enumerate(self.lists):
            body = " ".join(str(a) for a in acts)
            lines.append(f"{label} {s}: {body}".rstrip())
        return "\n".join(lines) + "\n"

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """Read the text form produced by ``str()`` (blank lines are ignored)."""
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        if not lines:
            raise ScheduleError("cannot parse an empty schedule text")
        header = _HEADER_RE.match(lines[0])
        if header is None:
            raise ScheduleError(
                f"bad schedule header {lines[0]!r}: expected '# <name> P=<P> m=<m> "
                "recompute=<True|False|one 0/1 per stage> [split_backward] "
                "[placement=<rank of each stage>]'"
            )
        name, p, m, rc_text, split, where = header.groups()
        rc: bool | tuple[bool, ...] = rc_text == "True" if rc_text in ("True", "False") else \
            tuple(c == "1" for c in rc_text)
        label, pattern = ("stage", _STAGE_RE) if where is None else ("rank", _RANK_RE)
        per_stage: list[list[Action]] = []
        for line in lines[1:]:
            match = pattern.match(line)
            if match is None or int(match.group(1)) != len(per_stage):
                raise ScheduleError(
                    f"bad schedule line {line!r}: expected '{label} {len(per_stage)}: <actions>'"
                )
            per_stage.append([Action.parse(tok) for tok in match.group(2).split()])
        if where is not None:
            ranks = tuple(int(r) for r in where.split(",") if r)
            if len(ranks) != int(p) or sorted(set(ranks)) != list(range(len(per_stage))):
                raise ScheduleError(
                    f"schedule placement {where!r} must name the rank (0..{len(per_stage) - 1}, "
                    f"each used) of each of the P={p} stages"
                )
            return cls.virtual(name, int(p), int(m), rc, ranks, per_stage,
                               split_backward=split is not None)
        if len(per_stage) != int(p):
            raise ScheduleError(f"schedule header says P={p} but {len(per_stage)} stages follow")
        return cls(name, int(p), int(m), rc, per_stage, split_backward=split is not None)
