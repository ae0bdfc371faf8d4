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
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from varuna_fx.errors import ScheduleError

_ACTION_RE = re.compile(r"^(\d+)([FRBW])(\d+)$")
_HEADER_RE = re.compile(
    r"^#\s*(.+?)\s+P=(\d+)\s+m=(\d+)\s+recompute=(True|False|[01]+)(\s+split_backward)?\s*$"
)
_STAGE_RE = re.compile(r"^stage\s+(\d+):(.*)$")


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
    """Per-stage ordered action lists for ``num_stages`` stages and ``num_micro_batches``."""

    name: str
    num_stages: int
    num_micro_batches: int
    recompute: bool | tuple[bool, ...]
    per_stage: list[list[Action]]
    split_backward: bool = False
    # Compiled simulation data (see structure.py); not part of the schedule's identity.
    _compiled: Any = field(default=None, init=False, repr=False, compare=False)
    # The ScheduleCosts a cost-aware order was generated from (None: parsed or unit costs).
    costs: Any = field(default=None, init=False, repr=False, compare=False)

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
        return (f"Schedule({self.name!r}, P={self.num_stages}, m={self.num_micro_batches}, "
                f"recompute={self.recompute})")

    def __str__(self) -> str:
        rc = self.recompute if isinstance(self.recompute, bool) else \
            "".join(str(int(r)) for r in self.recompute)
        split = " split_backward" if self.split_backward else ""
        lines = [f"# {self.name} P={self.num_stages} m={self.num_micro_batches} recompute={rc}{split}"]
        for s, acts in enumerate(self.per_stage):
            body = " ".join(str(a) for a in acts)
            lines.append(f"stage {s}: {body}".rstrip())
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
                "recompute=<True|False|one 0/1 per stage> [split_backward]'"
            )
        name, p, m, rc_text, split = header.groups()
        rc: bool | tuple[bool, ...] = rc_text == "True" if rc_text in ("True", "False") else \
            tuple(c == "1" for c in rc_text)
        per_stage: list[list[Action]] = []
        for line in lines[1:]:
            match = _STAGE_RE.match(line)
            if match is None or int(match.group(1)) != len(per_stage):
                raise ScheduleError(
                    f"bad schedule line {line!r}: expected 'stage {len(per_stage)}: <actions>'"
                )
            per_stage.append([Action.parse(tok) for tok in match.group(2).split()])
        if len(per_stage) != int(p):
            raise ScheduleError(f"schedule header says P={p} but {len(per_stage)} stages follow")
        return cls(name, int(p), int(m), rc, per_stage, split_backward=split is not None)
